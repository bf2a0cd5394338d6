"""Compressor softmax pooling in Triton: one entry per window, a per-channel softmax over the
window's rows. One program holds a (window, channel block) tile whole in registers and reads
each projected row and gate logit once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.quant import to_bf16_rne
from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def _compress_pool_kernel(
    kv_ptr, score_ptr, out_ptr, window, dim,
    stride_ke, stride_kl, stride_se, stride_sl, stride_oe,
    BL: tl.constexpr, BD: tl.constexpr, TO_BF16: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    slots = tl.arange(0, BL)
    mask = (slots < window)[:, None] & (cols < dim)[None, :]
    score = tl.load(
        score_ptr + e * stride_se + slots[:, None] * stride_sl + cols[None, :],
        mask=mask,
        other=float("-inf"),
    ).to(tl.float32)
    kv = tl.load(
        kv_ptr + e * stride_ke + slots[:, None] * stride_kl + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    peak = tl.max(score, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # masked-off channels only
    weight = tl.exp(score - peak[None, :])
    total = tl.sum(weight, axis=0)
    pooled = tl.sum(weight * kv, axis=0) / tl.where(cols < dim, total, 1.0)
    if TO_BF16:
        pooled = to_bf16_rne(pooled)
    tl.store(out_ptr + e * stride_oe + cols, pooled, mask=cols < dim)


@implements("compress_pool")
def compress_pool(kv, score, *, out_dtype=torch.float32):
    """A bf16 result is rounded in the kernel (:func:`.quant.to_bf16_rne`: exactly the separate
    cast it replaces); other narrow dtypes are cast after."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        return compress_pool(kv, score).to(out_dtype)
    if kv.dim() != 3:
        raise ValueError(f"kv: expected [E, L, d], got shape {tuple(kv.shape)}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    kv = kv if kv.stride(2) == 1 else kv.contiguous()
    score = score if score.stride(2) == 1 else score.contiguous()
    num_entries, window, dim = kv.shape
    out = torch.empty(num_entries, dim, dtype=out_dtype, device=kv.device)
    if num_entries == 0 or dim == 0:
        return out
    bl = triton.next_power_of_2(max(window, 1))
    bd = max(16, min(triton.next_power_of_2(dim), 8192 // bl))
    _compress_pool_kernel[(num_entries, triton.cdiv(dim, bd))](
        kv, score, out, window, dim,
        kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), out.stride(0),
        BL=bl, BD=bd, TO_BF16=out_dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return out
