"""Cases for compress_pool: the window lengths of V4 (ratio 4 overlapped = 8 rows, ratio 128)
and V4.1 (ratios 1, 2), with ``-inf`` slots for rows that do not exist."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance, with_kwargs


def _inputs(gen, device, *, entries, window, dim, dtype):
    kv = torch.randn(entries, window, dim, generator=gen).to(dtype)
    score = torch.randn(entries, window, dim, generator=gen) * 3
    if window > 1:
        missing = torch.rand(entries, window, generator=gen) < 0.3
        missing[:, 0] = False  # each (e, d) keeps a finite score
        score[missing] = float("-inf")
        score[0, : window // 2] = float("-inf")  # first overlapped window: no previous half
        score[0, window // 2] = torch.randn(dim, generator=gen)
    return (kv.to(device), score.to(device)), {}


def _strided(args):
    kv, score = args
    wide = torch.empty(kv.shape[0], kv.shape[1] + 1, kv.shape[2], dtype=kv.dtype, device=kv.device)
    wide[:, 1:] = kv
    return (wide[:, 1:], score)


def _cases(scale, shapes, dtypes):
    cases = []
    for entries, window, dim in shapes:
        for dtype in dtypes:
            atol, rtol = tolerance(torch.float32)
            make = functools.partial(_inputs, entries=entries, window=window, dim=dim, dtype=dtype)
            name = f"{entries}x{window}x{dim}-{str(dtype).removeprefix('torch.')}"
            cases.append(Case("compress_pool", name, scale, make, make_strided=_strided,
                              atol=4 * atol, rtol=4 * rtol))  # fmt: skip
        if scale == "small":
            # the result rounded to bf16 by the op: one bf16 ulp apart at most
            make = with_kwargs(make, out_dtype=torch.bfloat16)
            cases.append(Case("compress_pool", f"{name}-to-bf16", scale, make,
                              atol=1e-2, rtol=8e-3))  # fmt: skip
    return cases


register(
    *_cases(
        "small", [(3, 1, 64), (5, 2, 96), (6, 8, 64), (2, 128, 32)], [torch.float32, torch.bfloat16]
    ),  # fmt: skip
    *_cases(
        "real",
        [(4096, 8, 512), (4096, 8, 128), (64, 128, 512), (8192, 2, 512), (8192, 1, 512)],
        [torch.float32],
    ),  # fmt: skip
)
