"""Reference routed experts with FP4 weights: a plain loop over the experts that are used."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import moe, quant


def _maybe_fp8_sim(x: torch.Tensor, group: int | None) -> torch.Tensor:
    return x if group is None else quant.fp8_sim(x, group)


def fp4_moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    swiglu_limit: float,
    act_quant_group: int | None,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    xq = _maybe_fp8_sim(x.float(), act_quant_group)
    per_slot = torch.zeros(tokens, top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        w13_e = quant.fp4_dequant(w13[expert], w13_scale[expert], 32, out_dtype=torch.float32)
        gate_up = xq[rows] @ w13_e.t()
        hidden = moe.swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        hidden = (hidden * topk_weights[rows, slots].float().unsqueeze(-1)).bfloat16().float()
        w2_e = quant.fp4_dequant(w2[expert], w2_scale[expert], 32, out_dtype=torch.float32)
        down = _maybe_fp8_sim(hidden, act_quant_group) @ w2_e.t()
        per_slot[rows, slots] = down.bfloat16().float()
    out = per_slot[:, 0].clone()
    for slot in range(1, top_k):
        out = out + per_slot[:, slot]
    if shared is not None:
        out = out + shared.float()
    return out.to(out_dtype)
