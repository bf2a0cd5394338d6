"""Cases for indexer_scores: candidate lists with trailing ``-1`` padding and holes, duplicated
and unsorted candidates, bf16 / fp32 / FP8 keys."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register

TOL = 1e-4  # fp32 accumulation in another order


def make_candidates(gen, *, rows, width, num_keys):
    """``[rows, width]`` int32 unsorted rows of keys with duplicates, holes, trailing padding
    (row r sees a prefix of growing length, like causal visibility), the last row empty."""
    cand = torch.randint(0, num_keys, (rows, width), generator=gen)
    if width > 1:
        cand[:, 1] = cand[:, 0]
    cand[torch.rand(cand.shape, generator=gen) < 0.1] = -1
    visible = torch.linspace(width // 3, width, rows).long()
    cand[torch.arange(width)[None, :] >= visible[:, None]] = -1
    if rows >= 3:
        cand[-1] = -1
    return cand.to(torch.int32)


def _inputs(gen, device, *, rows, heads, dim, width, num_keys, dtype, key_dtype):
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(rows, heads, generator=gen) * (dim * heads) ** -0.5
    keys = torch.randn(num_keys, dim, generator=gen).to(key_dtype or dtype)
    cand = make_candidates(gen, rows=rows, width=width, num_keys=num_keys)
    return tuple(x.to(device) for x in (q, weights, keys, cand)), {}


def _strided(args):
    q, weights, keys, cand = args
    wide = torch.empty(*q.shape[:2], q.shape[2] + 16, dtype=q.dtype, device=q.device)
    wide[..., : q.shape[2]] = q
    return (wide[..., : q.shape[2]], weights.t().contiguous().t(), keys, cand)


def _case(scale, rows, heads, dim, width, num_keys, dtype, key_dtype=None):
    keys = "" if key_dtype is None else "-keysfp8"
    return Case(
        op="indexer_scores",
        name=f"{rows}x{heads}x{dim}-{width}of{num_keys}-{str(dtype).removeprefix('torch.')}{keys}",
        scale=scale,
        make_inputs=functools.partial(
            _inputs,
            rows=rows,
            heads=heads,
            dim=dim,
            width=width,
            num_keys=num_keys,
            dtype=dtype,
            key_dtype=key_dtype,
        ),  # fmt: skip
        make_strided=_strided,
        atol=TOL,
        rtol=TOL,
    )


FP8 = torch.float8_e4m3fn

register(
    _case("small", 1, 16, 32, 50, 80, torch.float32),
    _case("small", 5, 16, 64, 130, 300, torch.bfloat16),
    _case("small", 4, 24, 32, 70, 90, torch.bfloat16, FP8),
    _case("real", 64, 64, 128, 16384, 16384, torch.bfloat16),
    _case("real", 64, 64, 128, 16384, 16384, torch.bfloat16, FP8),
    _case("real", 64, 32, 128, 32768, 32768, torch.bfloat16),
    _case("real", 7, 64, 128, 4096, 8192, torch.float32),
)
