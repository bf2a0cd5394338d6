"""Reference lightning-indexer scoring and top-k selection."""

from __future__ import annotations

import torch


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    valid = candidates >= 0
    k = keys[candidates.clamp(min=0).long()].float()  # [T, C, d]
    dots = torch.einsum("thd,tcd->thc", q.float(), k).relu()
    scores = torch.einsum("th,thc->tc", weights.float(), dots)
    return scores.masked_fill(~valid, float("-inf"))


def select_topk(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    width = min(k, scores.shape[-1])
    top = scores.topk(width, dim=-1)
    picked = candidates.long().gather(-1, top.indices)
    picked = torch.where(torch.isfinite(top.values), picked, torch.full_like(picked, -1))
    if width < k:
        picked = torch.nn.functional.pad(picked, (0, k - width), value=-1)
    return picked
