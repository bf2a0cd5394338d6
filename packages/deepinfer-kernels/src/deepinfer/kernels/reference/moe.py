"""Reference MoE routing and clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _weights(scores, ids, route_scale, norm_eps, renormalize):
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + norm_eps)
    return w * route_scale


def route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    scoring_func: str,
    route_scale: float,
    norm_eps: float,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _score(logits, scoring_func)
    chooser = scores if bias is None else scores + bias.float()
    ids = chooser.topk(top_k, dim=-1).indices
    return _weights(scores, ids, route_scale, norm_eps, renormalize), ids


def route_hash(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    scoring_func: str,
    route_scale: float,
    norm_eps: float,
    renormalize: bool,
) -> torch.Tensor:
    scores = _score(logits, scoring_func)
    return _weights(scores, ids.long(), route_scale, norm_eps, renormalize)


def swiglu_clamped(
    gate: torch.Tensor, up: torch.Tensor, limit: float, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return (F.silu(g) * u).to(out_dtype)
