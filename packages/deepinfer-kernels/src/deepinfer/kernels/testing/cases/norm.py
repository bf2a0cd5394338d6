"""Cases for rms_norm and fused_add_rms_norm."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance

EPS = 1e-6


def _randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _norm_inputs(gen, device, *, rows, hidden, dtype, fused):
    x = _randn(gen, (rows, hidden), dtype, device, scale=3.0)
    weight = _randn(gen, (hidden,), torch.float32, device) * 0.5 + 1.0
    if fused:
        residual = _randn(gen, (rows, hidden), dtype, device, scale=3.0)
        return (x, residual, weight, EPS), {}
    return (x, weight, EPS), {}


def _strided(args):
    # Same values as non-contiguous views: rows padded (row stride > hidden) when there are
    # several rows, every other column of a wider tensor (column stride 2) for a single row.
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() == 2:
            rows, hidden = a.shape
            if rows > 1:
                wide = torch.randn(rows, hidden + 64, dtype=torch.float32).to(a.dtype).to(a.device)
                wide[:, :hidden] = a
                out.append(wide[:, :hidden])
            else:
                wide = torch.randn(rows, 2 * hidden, dtype=torch.float32).to(a.dtype).to(a.device)
                wide[:, ::2] = a
                out.append(wide[:, ::2])
        else:
            out.append(a)
    return tuple(out)


def _cases(scale, shapes, dtypes):
    cases = []
    for rows, hidden in shapes:
        for dtype in dtypes:
            atol, rtol = tolerance(dtype)
            for fused in (False, True):
                name = "fused_add_rms_norm" if fused else "rms_norm"
                cases.append(
                    Case(
                        op=name,
                        name=f"{rows}x{hidden}-{str(dtype).removeprefix('torch.')}",
                        scale=scale,
                        make_inputs=functools.partial(
                            _norm_inputs, rows=rows, hidden=hidden, dtype=dtype, fused=fused
                        ),
                        out_names=("out", "residual_out") if fused else ("out",),
                        make_strided=_strided,
                        atol=atol,
                        rtol=rtol,
                    )
                )
    return cases


register(
    *_cases("small", [(1, 64), (7, 96), (33, 256)], [torch.float32, torch.bfloat16, torch.float16]),
    *_cases(
        "real",
        [(1, 4096), (64, 4096), (16384, 4096), (1, 5120), (257, 5120), (16384, 5120), (3, 7168)],
        [torch.bfloat16, torch.float32],
    ),
)
