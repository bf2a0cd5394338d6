"""Cases for the MoE ops: routing (route_topk, route_hash), swiglu_clamped and fp4_moe_experts.

Routing is fp32 elementwise math plus a selection: weights within fp32 rounding, ids exact.
Random logits are not enough for that: near 1 a sigmoid's fp32 spacing merges logits ~1e-5
apart, so among thousands of tokens some top-k scores tie (or differ by one rounding between
implementations) and the order of the tied ids is arbitrary. Each token's logits are therefore a
random permutation of evenly spaced values in [-4, 4], jittered by a quarter of the spacing.
The bias (selection only) brings some ``score + bias`` pairs arbitrarily close again, so ids are
compared modulo near-ties (:mod:`deepinfer.kernels.testing.selection`) and the weights of each
row against the reference weights of the kernel's own ids.

fp4_moe_experts: FP4 weights dequantise exactly and every product is exact in fp32, so kernels
differ from the reference by summation order, by which side of an FP8 / bf16 rounding boundary
the hidden activation lands (one e4m3 step moves one term of the down projection by 1/16), and
-- under the Triton interpreter -- by its wrong fp32 -> e4m3 rounding.
Inputs are scaled so the output has unit spread; the tolerance is a few percent of that.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, with_kwargs
from deepinfer.kernels.testing.cases.gemm import _device_generator
from deepinfer.kernels.testing.selection import compare_route_topk

ROUTING = dict(route_scale=1.5, renormalize=True)


def _route_inputs(gen, device, *, tokens, experts, top_k, scoring_func, norm_eps, with_bias):
    g = _device_generator(gen, device)
    spacing = 8.0 / max(experts - 1, 1)
    levels = torch.linspace(-4.0, 4.0, experts, device=device)
    order = torch.rand(tokens, experts, generator=g, device=device).argsort(dim=-1)
    jitter = (torch.rand(tokens, experts, generator=g, device=device) - 0.5) * (spacing / 2)
    logits = levels[order] + jitter  # no two logits of a token closer than spacing / 2
    bias = torch.randn(experts, generator=g, device=device) * 0.1 if with_bias else None
    kwargs = dict(ROUTING, scoring_func=scoring_func, norm_eps=norm_eps)
    return (logits, bias, top_k), kwargs


def _hash_inputs(gen, device, *, tokens, experts, top_k, scoring_func, norm_eps):
    g = _device_generator(gen, device)
    logits = torch.randn(tokens, experts, generator=g, device=device) * 2
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, device=device)
    return (logits, ids), dict(ROUTING, scoring_func=scoring_func, norm_eps=norm_eps)


def _swiglu_inputs(gen, device, *, tokens, inter, dtype):
    g = _device_generator(gen, device)
    gate = (torch.randn(tokens, inter, generator=g, device=device) * 6).to(dtype)
    up = (torch.randn(tokens, inter, generator=g, device=device) * 6).to(dtype)
    return (gate, up, 10.0), {}


def random_fp4_weight(g, shape, device):
    """``(packed int8 [..., K/2], scale e8m0 [..., K/32])`` with entries of spread ~1/sqrt(K)."""
    *lead, k = shape
    packed = torch.randint(-128, 128, (*lead, k // 2), generator=g, device=device, dtype=torch.int8)
    centre = 127 - 2 - round(0.5 * torch.log2(torch.tensor(float(k))).item())
    exps = torch.randint(centre - 1, centre + 2, (*lead, k // 32), generator=g, device=device)
    return packed, exps.to(torch.uint8).view(torch.float8_e8m0fnu)


def _experts_inputs(gen, device, *, tokens, experts, top_k, dim, inter, group, ids_dtype):
    g = _device_generator(gen, device)
    x = torch.randn(tokens, dim, generator=g, device=device).bfloat16()
    scores = torch.rand(tokens, experts, generator=g, device=device)
    ids = scores.topk(top_k, dim=-1).indices.to(ids_dtype)
    weights = torch.rand(tokens, top_k, generator=g, device=device) + 0.25
    w13, w13_scale = random_fp4_weight(g, (experts, 2 * inter, dim), device)
    w2, w2_scale = random_fp4_weight(g, (experts, dim, inter), device)
    args = (x, weights, ids, w13, w13_scale, w2, w2_scale)
    return args, {"swiglu_limit": 10.0, "act_quant_group": group}


def _routing_cases(scale, shapes):
    cases = []
    for tokens, experts, top_k in shapes:
        tag = f"{tokens}x{experts}-top{top_k}"
        for func in ("sqrtsoftplus", "sigmoid", "softmax"):
            for with_bias, eps in ((True, 0.0), (False, 1e-20)):
                make = functools.partial(
                    _route_inputs, tokens=tokens, experts=experts, top_k=top_k,
                    scoring_func=func, norm_eps=eps, with_bias=with_bias,
                )  # fmt: skip
                name = f"{tag}-{func}-{'bias' if with_bias else 'nobias'}"
                cases.append(
                    Case("route_topk", name, scale, make, atol=1e-6, rtol=1e-5,
                         compare=compare_route_topk)
                )  # fmt: skip
            make = functools.partial(
                _hash_inputs, tokens=tokens, experts=experts, top_k=top_k,
                scoring_func=func, norm_eps=0.0,
            )  # fmt: skip
            cases.append(Case("route_hash", f"{tag}-{func}", scale, make, atol=1e-6, rtol=1e-5))
    return cases


def _swiglu_cases(scale, shapes):
    cases = []
    for tokens, inter in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            make = functools.partial(_swiglu_inputs, tokens=tokens, inter=inter, dtype=dtype)
            name = f"{tokens}x{inter}-{str(dtype).removeprefix('torch.')}"
            cases.append(Case("swiglu_clamped", name, scale, make, atol=1e-5, rtol=1e-5))
            # the result rounded to bf16 by the op: one bf16 ulp apart at most
            narrow = with_kwargs(make, out_dtype=torch.bfloat16)
            cases.append(Case("swiglu_clamped", f"{name}-to-bf16", scale, narrow,
                              atol=1e-2, rtol=8e-3))  # fmt: skip
    return cases


def _expert_cases(scale, shapes):
    cases = []
    for tokens, experts, top_k, dim, inter, group in shapes:
        for ids_dtype in (torch.int64, torch.int32):
            make = functools.partial(
                _experts_inputs, tokens=tokens, experts=experts, top_k=top_k, dim=dim,
                inter=inter, group=group, ids_dtype=ids_dtype,
            )  # fmt: skip
            name = f"{tokens}t-{experts}e-top{top_k}-{dim}x{inter}-g{group}-{ids_dtype}"
            cases.append(Case("fp4_moe_experts", name, scale, make, atol=4e-2, rtol=2e-2))
        # the shared expert's rows added and the sum rounded to bf16 in the op
        with_shared = functools.partial(_with_shared, make=make)
        cases.append(Case("fp4_moe_experts", f"{name}-shared-to-bf16", scale, with_shared,
                          atol=6e-2, rtol=2e-2))  # fmt: skip
    return cases


def _with_shared(gen, device, *, make):
    args, kwargs = make(gen, device)
    x = args[0]
    shared = torch.randn(x.shape, generator=_device_generator(gen, device), device=device)
    return args, {**kwargs, "shared": shared.bfloat16(), "out_dtype": torch.bfloat16}


register(
    *_routing_cases("small", [(5, 16, 3), (33, 64, 6)]),
    *_swiglu_cases("small", [(3, 64), (17, 96)]),
    *_expert_cases(
        "small", [(9, 6, 3, 128, 128, 128), (5, 8, 2, 96, 64, 32), (4, 4, 2, 64, 64, None)]
    ),
    *_routing_cases("real", [(1, 256, 6), (8192, 256, 6), (64, 384, 6), (4096, 384, 6)]),
    *_swiglu_cases("real", [(4096, 2048), (64, 2304)]),
    *_expert_cases(
        "real",
        [
            (64, 256, 6, 4096, 2048, 128),
            (2048, 256, 6, 4096, 2048, 128),
            (64, 384, 6, 5120, 2304, 32),
            (1000, 384, 6, 5120, 2304, 32),
        ],
    ),  # fmt: skip
)
