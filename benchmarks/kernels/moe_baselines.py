"""The torch baselines of ``bench_moe.py``: the routed experts as ``torch._grouped_mm`` over
experts dequantised to bf16, from FP4 per call or ahead of time."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import moe as ref_moe
from deepinfer.kernels.reference import quant as ref_quant


def dequant_bf16(packed, scale, chunk=32):
    parts = [ref_quant.fp4_dequant(packed[i : i + chunk], scale[i : i + chunk], 32)
             for i in range(0, packed.shape[0], chunk)]  # fmt: skip
    return torch.cat(parts)


def _grouped_matmul(rows, weight, offs):
    """``rows[offs[g-1]:offs[g]] @ weight[g]^T`` per group: ``torch._grouped_mm`` where this
    torch has it for these operands, else a loop of ``torch.mm`` (host sync)."""
    try:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)
    except (AttributeError, RuntimeError):
        ends = offs.tolist()
        out = rows.new_empty((rows.shape[0], weight.shape[1]))
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            if end > start:
                out[start:end] = rows[start:end] @ weight[g].t()
        return out


def torch_moe(x, weights, ids, w13_bf16, w2_bf16, *, limit):
    """bf16 ``torch._grouped_mm`` over dequantised experts (``[E', 2I, D]``, ``[E', D, I]``)."""
    top_k = ids.shape[1]
    inter = w13_bf16.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(w13_bf16.shape[0], dtype=torch.int64, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x.bfloat16()[order // top_k]
    gate_up = _grouped_matmul(rows, w13_bf16, offs)
    hidden = ref_moe.swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], limit)
    hidden = (hidden * weights.reshape(-1)[order, None]).bfloat16()
    down = _grouped_matmul(hidden, w2_bf16, offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // top_k, down.float())


def torch_moe_from_fp4(x, weights, ids, w13, s13, w2, s2, *, limit):
    used, local = torch.unique(ids, return_inverse=True)
    w13_bf16, w2_bf16 = dequant_bf16(w13[used], s13[used]), dequant_bf16(w2[used], s2[used])
    return torch_moe(x, weights, local, w13_bf16, w2_bf16, limit=limit)
