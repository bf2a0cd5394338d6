"""Counter-based random numbers keyed by (seed, position, stream, counter).

Every random draw the sampler or the speculative-acceptance code makes is a pure function of the
request's seed, the absolute position of the token being produced, a stream id naming the use
(``STREAM_SAMPLE``, ``STREAM_DRAFT``, ``STREAM_ACCEPT``, ``STREAM_RESIDUAL``) and a counter
(the vocabulary index for Gumbel noise, 0 for a single coin). Nothing is stateful, so a row
gives the same numbers whatever the batch, its index in it, or the device: the hash is integer
arithmetic (SplitMix64's finaliser, wrapping int64 multiplies) and the conversion to float keeps
24 bits, which float32 represents exactly on every device.
"""

from __future__ import annotations

import torch

STREAM_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_POS = _i64(0xD6E8FEB86659FD93)
_STREAM = _i64(0xA0761D6478BD642F)


def _stream_term(stream: int) -> int:
    """``stream * _STREAM`` wrapped to int64, as the tensor arithmetic would wrap it."""
    return _i64((stream * _STREAM) % (1 << 64))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def hash64(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int, counters: torch.Tensor
) -> torch.Tensor:
    """64-bit hashes ``[B, N]`` (int64 bit patterns) of (seed[b], position[b], stream, counter[n]).

    seeds, positions: ``[B]`` int64; counters: ``[N]`` int64; all on one device.
    """
    key = _mix(
        seeds.to(torch.int64) * _GOLDEN + positions.to(torch.int64) * _POS + _stream_term(stream)
    )
    return _mix(key[:, None] + (counters.to(torch.int64)[None, :] + 1) * _GOLDEN)


def uniform(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
    num: int,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Uniform floats in the open interval (0, 1), float32 ``[B, num]``.

    Column ``j`` uses counter ``offset + j``. Values are ``(k + 0.5) / 2**24`` for a 24-bit
    integer ``k`` taken from the hash's top bits, identical on every device.
    """
    counters = torch.arange(offset, offset + num, device=seeds.device, dtype=torch.int64)
    bits = _shr(hash64(seeds, positions, stream, counters), 40)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` float32 ``[B, num]`` from :func:`uniform`."""
    u = uniform(seeds, positions, stream, num)
    return -torch.log(-torch.log(u))


def random_seeds(n: int, generator: torch.Generator | None = None) -> list[int]:
    """Fresh 63-bit seeds for requests that gave none (unset ``seq_seed`` means random)."""
    return torch.randint(0, 2**63 - 1, (n,), generator=generator, dtype=torch.int64).tolist()


__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESIDUAL",
    "STREAM_SAMPLE",
    "gumbel",
    "hash64",
    "random_seeds",
    "uniform",
]
