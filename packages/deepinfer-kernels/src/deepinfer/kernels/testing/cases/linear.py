"""Cases for grouped_linear (the grouped attention output projection, wo_a); linear has its
cases in gemm.py."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance


def _inputs(gen, device, *, tokens, groups, k, n, dtype, fp8):
    x = (torch.randn(tokens, groups, k, generator=gen)).to(dtype).to(device)
    w = torch.randn(groups * n, k, generator=gen) * k**-0.5
    if not fp8:
        return (x, w.to(dtype).to(device)), {}
    from deepinfer.kernels.reference.quant import fp8_block_quant

    q, scale = fp8_block_quant(w, (128, 128))
    return (x, q.to(device), scale.to(device)), {"block_size": (128, 128)}


def _strided(args):
    x = args[0]
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return (wide[..., ::2], *args[1:])


def _cases(scale, shapes):
    cases = []
    for tokens, groups, k, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for fp8 in (False, True):
                atol, rtol = tolerance(dtype)
                if dtype == torch.bfloat16:
                    atol, rtol = 4 * atol, 4 * rtol  # a length-k dot product, rounded once
                name = f"{tokens}x{groups}x{k}->{n}-{str(dtype)[6:]}{'-fp8' if fp8 else ''}"
                make = functools.partial(
                    _inputs, tokens=tokens, groups=groups, k=k, n=n, dtype=dtype, fp8=fp8
                )
                cases.append(
                    Case(
                        "grouped_linear",
                        name,
                        scale,
                        make,
                        make_strided=_strided,
                        atol=atol,
                        rtol=rtol,
                    )
                )
    return cases


register(
    # 520 rows: prefill-sized, where a backend may take another route than for few rows
    *_cases("small", [(3, 2, 128, 16), (5, 4, 256, 32), (520, 2, 128, 16)]),
    *_cases("real", [(64, 8, 4096, 1024), (1024, 8, 4096, 1024)]),
)
