"""The counter-based hash behind every random draw (SplitMix64's finaliser over int64 tensors).

One definition for the whole project: ``deepinfer.sampling.rng`` builds its uniforms and Gumbel
noise on it and the sampling ops' reference twins use it, so device kernels have one bit-exact
target. Multiplies wrap in int64 exactly as the unsigned 64-bit arithmetic would.
"""

from __future__ import annotations

import torch


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


GOLDEN = _i64(0x9E3779B97F4A7C15)
MIX1 = _i64(0xBF58476D1CE4E5B9)
MIX2 = _i64(0x94D049BB133111EB)
POS = _i64(0xD6E8FEB86659FD93)
STREAM = _i64(0xA0761D6478BD642F)


def stream_term(stream: int) -> int:
    """``stream * STREAM`` wrapped to int64, as the tensor arithmetic would wrap it."""
    return _i64((stream * STREAM) % (1 << 64))


def shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ shr(z, 30)) * MIX1
    z = (z ^ shr(z, 27)) * MIX2
    return z ^ shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The per-row key ``[B]`` int64 of (seed, position, stream); counters mix into it."""
    return mix(
        seeds.to(torch.int64) * GOLDEN + positions.to(torch.int64) * POS + stream_term(stream)
    )


def hash64(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int, counters: torch.Tensor
) -> torch.Tensor:
    """``[B, N]`` int64 hashes of (seed[b], position[b], stream, counter[n])."""
    key = row_keys(seeds, positions, stream)
    return mix(key[:, None] + (counters.to(torch.int64)[None, :] + 1) * GOLDEN)


def uniform24(bits: torch.Tensor) -> torch.Tensor:
    """Floats in (0, 1) from the top 24 bits of int64 hashes: ``(k + 0.5) / 2**24``, exact in
    float32 on every device."""
    return (shr(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
