"""Reference sparse multi-query attention with a per-head sink."""

from __future__ import annotations

import torch


def sparse_mqa_sink(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    valid = indices >= 0  # [T, K]
    gathered = kv[indices.clamp(min=0).long()].float()  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), gathered) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    peak = torch.maximum(logits.amax(-1, keepdim=True), sink_logit)
    probs = torch.exp(logits - peak)
    denom = probs.sum(-1, keepdim=True) + torch.exp(sink_logit - peak)
    out = torch.einsum("thk,tkd->thd", probs / denom, gathered)
    return out.to(q.dtype)
