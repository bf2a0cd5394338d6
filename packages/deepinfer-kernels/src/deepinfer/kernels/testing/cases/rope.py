"""Cases for apply_rope: partial interleaved RoPE on ``[N, D]`` and ``[N, H, D]``, forward and
inverse, at the attention (D 512, rd 64) and indexer (D 128, rd 64) shapes; into ``out=`` and in
place (``out=x``)."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance


def _inputs(gen, device, *, shape, rope_dim, dtype, inverse):
    x = torch.randn(shape, generator=gen).to(dtype)
    angles = torch.rand(shape[0], rope_dim // 2, generator=gen) * 100
    cos, sin = torch.cos(angles), torch.sin(angles)
    return (x.to(device), cos.to(device), sin.to(device)), {"inverse": inverse}


def _strided(args):
    x, cos, sin = args
    wide = torch.empty(*x.shape[:-1], x.shape[-1] + 8, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return (wide[..., : x.shape[-1]], cos, sin)


def _cases(scale, shapes, dtypes):
    cases = []
    for shape, rope_dim in shapes:
        for dtype in dtypes:
            atol, rtol = tolerance(dtype)
            for inverse in (False, True):
                name = "x".join(map(str, shape)) + f"-rd{rope_dim}-"
                name += str(dtype).removeprefix("torch.") + ("-inverse" if inverse else "")
                make = functools.partial(
                    _inputs, shape=shape, rope_dim=rope_dim, dtype=dtype, inverse=inverse
                )
                cases.append(Case("apply_rope", name, scale, make, out_names=("out",),
                                  make_strided=_strided, atol=atol, rtol=rtol,
                                  in_place=0))  # fmt: skip
    return cases


register(
    *_cases(
        "small",
        [((5, 64), 16), ((3, 20, 48), 16), ((4, 2, 32), 32)],
        [torch.float32, torch.bfloat16],
    ),  # fmt: skip
    *_cases(
        "real",
        [((64, 64, 512), 64), ((8192, 64, 512), 64), ((8192, 512), 64), ((256, 64, 128), 64)],
        [torch.bfloat16],
    ),  # fmt: skip
)
