"""Counter-based random numbers keyed by (seed, position, stream, counter).

Every random draw the sampler or the speculative-acceptance code makes is a pure function of the
request's seed, the absolute position of the token being produced, a stream id naming the use
(``STREAM_SAMPLE``, ``STREAM_DRAFT``, ``STREAM_ACCEPT``, ``STREAM_RESIDUAL``) and a counter
(the vocabulary index for Gumbel noise, 0 for a single coin). Nothing is stateful, so a row
gives the same numbers whatever the batch, its index in it, or the device: the hash is integer
arithmetic (:mod:`deepinfer.kernels.counter_hash`: SplitMix64's finaliser, wrapping int64
multiplies) and the conversion to float keeps
24 bits, which float32 represents exactly on every device.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import counter_hash

STREAM_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3


hash64 = counter_hash.hash64


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
    return counter_hash.uniform24(hash64(seeds, positions, stream, counters))


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
