"""Cases for the vision ops: image grids of several aspect ratios (some not multiples of the
unfold ratio), the tiny tower's and the released tower's head sizes."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance


def _randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _attention(gen, device, *, n, heads, dim, dtype):
    q, k, v = (_randn(gen, (n, heads, dim), dtype, device, 2.0) for _ in range(3))
    return (q, k, v), {}


def _rope(gen, device, *, n, heads, dim, dtype):
    x = _randn(gen, (n, heads, dim), dtype, device)
    angles = torch.rand(n, dim // 2, generator=gen) * 40
    return (x, angles.cos().to(device), angles.sin().to(device)), {}


def _unfold(gen, device, *, n_h, n_w, channels, ratio, dtype):
    return (_randn(gen, (n_h * n_w, channels), dtype, device), n_h, n_w, ratio), {}


def _unary(gen, device, *, shape, dtype):
    return (_randn(gen, shape, dtype, device, 3.0),), {}


def _binary(gen, device, *, shape, dtype):
    return (_randn(gen, shape, dtype, device, 3.0), _randn(gen, shape, dtype, device, 3.0)), {}


def _case(op, name, scale, make, dtype, factor=4.0):
    atol, rtol = tolerance(dtype)
    return Case(op, f"{name}-{str(dtype).removeprefix('torch.')}", scale, make,
                atol=factor * atol, rtol=factor * rtol)  # fmt: skip


def _cases(scale, grids, heads, dim, dtypes):
    cases = []
    for dtype in dtypes:
        for n_h, n_w in grids:
            n = n_h * n_w
            kw = dict(n=n, heads=heads, dim=dim, dtype=dtype)
            cases += [
                _case("vision_attention", f"{n}x{heads}x{dim}", scale,
                      functools.partial(_attention, **kw), dtype),
                _case("rope_rotate_half", f"{n}x{heads}x{dim}", scale,
                      functools.partial(_rope, **kw), dtype),
                _case("patch_unfold", f"{n_h}x{n_w}x{heads * dim}", scale,
                      functools.partial(_unfold, n_h=n_h, n_w=n_w, channels=heads * dim,
                                        ratio=3, dtype=dtype), dtype, 1.0),
                _case("gelu", f"{n}x{heads * dim}", scale,
                      functools.partial(_unary, shape=(n, heads * dim), dtype=dtype), dtype),
                _case("silu_mul", f"{n}x{heads * dim}", scale,
                      functools.partial(_binary, shape=(n, heads * dim), dtype=dtype), dtype),
            ]  # fmt: skip
    return cases


register(
    *_cases("small", [(3, 3), (4, 7), (8, 2)], 2, 16, [torch.float32, torch.bfloat16]),
    *_cases("real", [(39, 39), (24, 60)], 16, 64, [torch.bfloat16]),
)
