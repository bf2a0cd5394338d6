"""Cases for the fused mHC pre site ``hc_pre`` (coefficients + collapse), with the V4 collapse
(this site's ``pre``) and V4.1's deferred one (``collapse_pre`` given)."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance

NC = 4
COEFF_TOL = 1e-4  # fp32, but a different summation order over nc * D products


def _pre_inputs(gen, device, *, tokens, dim, dtype, deferred):
    width = NC * dim
    num_out = (2 + NC) * NC
    x = (torch.randn(tokens, NC, dim, generator=gen) * 2).to(dtype)
    fn = torch.randn(num_out, width, generator=gen) * width**-0.5
    base = torch.randn(num_out, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    kwargs = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
    if deferred:
        kwargs["collapse_pre"] = (torch.rand(tokens, NC, generator=gen) + 0.1).to(device)
    return tuple(t.to(device) for t in (x, fn, base, scale)), kwargs


def _strided_streams(args):
    """x as a view with padded rows."""
    x, *rest = args
    wide = torch.empty(x.shape[0], NC, x.shape[2] + 32, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[2]] = x
    return (wide[..., : x.shape[2]], *rest)


def _cases(scale, tokens_list, dims, dtypes):
    cases = []
    for tokens in tokens_list:
        for dim in dims:
            for dtype in dtypes:
                # one tolerance for all four outputs: y's rounding (bf16), or the coefficients'
                atol, rtol = max(tolerance(dtype), (COEFF_TOL, COEFF_TOL))
                for deferred in (False, True):
                    name = f"{tokens}x{NC}x{dim}-{str(dtype).removeprefix('torch.')}"
                    name += "-deferred" if deferred else ""
                    make = functools.partial(
                        _pre_inputs, tokens=tokens, dim=dim, dtype=dtype, deferred=deferred
                    )
                    cases.append(Case("hc_pre", name, scale, make, make_strided=_strided_streams,
                                      atol=atol, rtol=rtol))  # fmt: skip
    return cases


register(
    *_cases("small", [1, 5, 37], [64, 320], [torch.float32, torch.bfloat16]),
    *_cases("real", [1, 64, 4096], [4096, 5120, 7168], [torch.bfloat16]),
    *_cases("real", [33], [4096], [torch.float32]),
)
