"""MoE routing (score top-k and hash) and the clamped SwiGLU, in Triton.

Routing: one program per token holds the token's ``E`` router logits in registers, scores them
(``sqrtsoftplus``, ``sigmoid`` or ``softmax``), picks ``k`` experts by repeated arg-max over
``score + bias`` (the bias steers selection only), gathers the unbiased scores, renormalises and
scales. Each token is independent of the others, so routing is batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.quant import to_bf16_rne
from deepinfer.kernels_nvidia.registry import implements

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _log1p(y):
    """``log(1 + y)`` accurate for small ``y`` (Goldberg's correction)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))


@triton.jit
def _score(logits, row_max, row_sum, SCORING: tl.constexpr):
    if SCORING == 0:  # sqrt(softplus(x)), softplus's linear branch above 20 as in torch
        soft = tl.where(logits > 20.0, logits, _log1p(tl.exp(tl.minimum(logits, 20.0))))
        return tl.sqrt(soft)
    elif SCORING == 1:
        return 1.0 / (1.0 + tl.exp(-logits))
    else:
        return tl.exp(logits - row_max) / row_sum


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_in_ptr, weights_ptr, ids_out_ptr,
    num_experts, stride_l, route_scale, norm_eps,
    TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=valid, other=-float("inf"))
    logits = logits.to(tl.float32)
    row_max = tl.max(logits, axis=0)
    row_sum = tl.sum(tl.where(valid, tl.exp(logits - row_max), 0.0), axis=0)
    slots = tl.arange(0, BLOCK_K)
    slot_valid = slots < TOP_K
    if HASH:
        ids = tl.load(ids_in_ptr + token * TOP_K + slots, mask=slot_valid, other=0)
        picked = tl.load(logits_ptr + token * stride_l + ids, mask=slot_valid, other=0.0)
        weights = _score(picked.to(tl.float32), row_max, row_sum, SCORING)
    else:
        scores = _score(logits, row_max, row_sum, SCORING)
        chooser = scores
        if HAS_BIAS:
            chooser += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
        chooser = tl.where(valid, chooser, -float("inf"))
        weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(chooser, axis=0)
            weights = tl.where(slots == j, tl.sum(tl.where(experts == best, scores, 0.0)), weights)
            ids = tl.where(slots == j, best.to(tl.int64), ids)
            chooser = tl.where(experts == best, -float("inf"), chooser)
        tl.store(ids_out_ptr + token * TOP_K + slots, ids, mask=slot_valid)
    weights = tl.where(slot_valid, weights, 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + norm_eps)
    tl.store(weights_ptr + token * TOP_K + slots, weights * route_scale, mask=slot_valid)


def _launch_route(logits, bias, ids_in, top_k, scoring_func, route_scale, norm_eps, renormalize):
    if scoring_func not in SCORING:
        raise ValueError(f"scoring_func={scoring_func!r}: expected one of {sorted(SCORING)}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, E], got shape {tuple(logits.shape)}")
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: expected 1..{num_experts}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids_out = ids_in if ids_in is not None else torch.empty_like(weights, dtype=torch.int64)
    if tokens == 0:
        return weights, ids_out
    _route_kernel[(tokens,)](
        logits, bias if bias is not None else logits, ids_in if ids_in is not None else ids_out,
        weights, ids_out, num_experts, logits.stride(0), float(route_scale), float(norm_eps),
        TOP_K=top_k, SCORING=SCORING[scoring_func], HAS_BIAS=bias is not None,
        HASH=ids_in is not None, RENORMALIZE=bool(renormalize),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if num_experts <= 512 else 8,
    )  # fmt: skip
    return weights, ids_out


@implements("route_topk")
def route_topk(logits, bias, top_k, *, scoring_func, route_scale, norm_eps, renormalize):
    if bias is not None:
        bias = bias.float().contiguous()
    return _launch_route(
        logits, bias, None, top_k, scoring_func, route_scale, norm_eps, renormalize
    )


@implements("route_hash")
def route_hash(logits, ids, *, scoring_func, route_scale, norm_eps, renormalize):
    if ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"ids: expected [{logits.shape[0]}, k], got shape {tuple(ids.shape)}")
    ids64 = ids.to(torch.int64).contiguous()
    weights, _ = _launch_route(
        logits, None, ids64, ids.shape[1], scoring_func, route_scale, norm_eps, renormalize
    )
    return weights


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, limit, BLOCK: tl.constexpr,
                   TO_BF16: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.minimum(tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.clamp(tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32), -limit, limit)
    y = g / (1.0 + tl.exp(-g)) * u
    if TO_BF16:
        y = to_bf16_rne(y)
    tl.store(out_ptr + offs, y, mask=mask)


@implements("swiglu_clamped")
def swiglu_clamped(
    gate: torch.Tensor, up: torch.Tensor, limit: float, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A bf16 result is rounded in the kernel (round to nearest even on the bits, exactly the
    separate cast it replaces, the interpreter included); other narrow dtypes are cast after."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)}: expected one shape")
    if out_dtype not in (torch.float32, torch.bfloat16):
        return swiglu_clamped(gate, up, limit).to(out_dtype)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    n = gate.numel()
    block = 1024
    if n:
        to_bf16 = out_dtype == torch.bfloat16
        _swiglu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, float(limit), BLOCK=block,
                                                 TO_BF16=to_bf16)  # fmt: skip
    return out
