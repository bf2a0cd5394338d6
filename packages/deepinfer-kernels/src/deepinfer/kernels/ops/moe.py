"""Mixture-of-experts routing (score and hash) and the clamped SwiGLU of the experts."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import moe as ref
from deepinfer.kernels.registry import op

__all__ = ["route_topk", "route_hash", "swiglu_clamped"]


@op(reference=ref.route_topk)
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
    """Score routing: ``s = score(logits)``; experts ``ids = topk(s + bias)`` (bias for
    selection only); ``w = s[ids]``, ``w /= sum w + norm_eps`` if ``renormalize``; ``w *= scale``.

    logits: ``[T, E]`` router logits (fp32). bias: ``[E]`` fp32 or None.
    scoring_func: ``sqrtsoftplus`` (``sqrt(softplus(x))``), ``sigmoid`` or ``softmax``.
    Returns weights ``[T, top_k]`` fp32 and ids ``[T, top_k]`` int64 (unspecified order).
    """


@op(reference=ref.route_hash)
def route_hash(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    scoring_func: str,
    route_scale: float,
    norm_eps: float,
    renormalize: bool,
) -> torch.Tensor:
    """Hash routing: the experts are given (``ids = tid2eid[token]``, ``[T, k]`` int), the
    weights are computed from the router scores as in :func:`route_topk`. Returns ``[T, k]``
    fp32."""


@op(reference=ref.swiglu_clamped)
def swiglu_clamped(
    gate: torch.Tensor, up: torch.Tensor, limit: float, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32.

    gate, up: ``[T, I]`` any float dtype. Returns ``[T, I]`` of ``out_dtype``: the fp32 result,
    rounded once (round to nearest even) when ``out_dtype`` is narrower, as ``.to`` does.
    """
