"""Cases for the mHC ops: the fused pre site ``hc_pre`` (coefficients + collapse, with the V4
collapse and V4.1's deferred one, ``collapse_pre`` given), hc_mix_coefficients,
hc_head_coefficients, hc_collapse and hc_expand."""

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


def _coeff_inputs(gen, device, *, tokens, dim, dtype, head):
    width = NC * dim
    num_out = NC if head else (2 + NC) * NC
    x = (torch.randn(tokens, NC, dim, generator=gen) * 2).to(dtype)
    fn = torch.randn(num_out, width, generator=gen) * width**-0.5
    base = torch.randn(num_out, generator=gen) * 0.5
    scale = torch.rand(1 if head else 3, generator=gen) + 0.5
    kwargs = {"norm_eps": 1e-6, "hc_eps": 1e-6}
    if not head:
        kwargs["sinkhorn_iters"] = 20
    return tuple(t.to(device) for t in (x, fn, base, scale)), kwargs


def _mix_inputs(gen, device, *, tokens, dim, dtype, expand):
    h = (torch.randn(tokens, NC, dim, generator=gen) * 2).to(dtype).to(device)
    pre = (torch.rand(tokens, NC, generator=gen) + 0.1).to(device)
    if not expand:
        return (h, pre), {}
    f = torch.randn(tokens, dim, generator=gen).to(dtype).to(device)
    comb = torch.rand(tokens, NC, NC, generator=gen).to(device)
    return (f, h, pre * 2, comb), {}


def _strided_streams(args):
    """The ``[T, nc, D]`` argument as a view with padded rows."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[1] == NC and a.shape[2] > NC:
            wide = torch.empty(a.shape[0], NC, a.shape[2] + 32, dtype=a.dtype, device=a.device)
            wide[..., : a.shape[2]] = a
            a = wide[..., : a.shape[2]]
        out.append(a)
    return tuple(out)


def _pre_cases(scale, tokens_list, dims, dtypes):
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


def _op_cases(scale, tokens_list, dims, dtypes):
    cases = []
    for tokens in tokens_list:
        for dim in dims:
            for dtype in dtypes:
                name = f"{tokens}x{NC}x{dim}-{str(dtype).removeprefix('torch.')}"
                atol, rtol = tolerance(dtype)
                for op, head in (("hc_mix_coefficients", False), ("hc_head_coefficients", True)):
                    make = functools.partial(
                        _coeff_inputs, tokens=tokens, dim=dim, dtype=dtype, head=head
                    )
                    cases.append(Case(op, name, scale, make, make_strided=_strided_streams,
                                      atol=COEFF_TOL, rtol=COEFF_TOL))  # fmt: skip
                for op, expand in (("hc_collapse", False), ("hc_expand", True)):
                    make = functools.partial(
                        _mix_inputs, tokens=tokens, dim=dim, dtype=dtype, expand=expand
                    )
                    cases.append(Case(op, name, scale, make, make_strided=_strided_streams,
                                      atol=atol, rtol=rtol))  # fmt: skip
    return cases


register(
    *_pre_cases("small", [1, 5, 37], [64, 320], [torch.float32, torch.bfloat16]),
    *_pre_cases("real", [1, 64, 4096], [4096, 5120, 7168], [torch.bfloat16]),
    *_pre_cases("real", [33], [4096], [torch.float32]),
    *_op_cases("small", [1, 5, 37], [64, 320], [torch.float32, torch.bfloat16]),
    *_op_cases("real", [1, 64, 4096], [4096, 7168], [torch.bfloat16]),
    *_op_cases("real", [33], [4096], [torch.float32]),
)
