"""Sparse multi-query attention over per-query index lists (DESIGN.md section 5)."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import attention as ref
from deepinfer.kernels.registry import op

__all__ = ["sparse_mqa_sink"]


@op(reference=ref.sparse_mqa_sink)
def sparse_mqa_sink(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """One shared K=V head attended by every query head, over the rows each query lists.

    q:       ``[T, H, D]`` fp32 / bf16, one row per query token.
    kv:      ``[M, D]`` same dtype: the key and value rows (window slots, this step's tokens,
             compressed entries -- whatever the caller laid out).
    indices: ``[T, K]`` int32 / int64 rows of ``kv`` query ``t`` attends to; ``-1`` = skip.
             Order is irrelevant; duplicates count twice (callers never produce them).
    sink:    ``[H]`` fp32 per-head sink logit: an extra logit with a zero value vector.
    For each (t, h): ``l_i = scale * q[t,h] . kv[idx_i]`` over valid i (fp32);
    ``out = sum_i exp(l_i - M) kv[idx_i] / (sum_i exp(l_i - M) + exp(sink_h - M))``.
    A query with no valid index returns zeros. Returns ``[T, H, D]`` of ``q.dtype``.
    """
