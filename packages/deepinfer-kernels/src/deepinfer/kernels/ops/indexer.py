"""Lightning indexer: score compressed entries for each query, keep the top k."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import indexer as ref
from deepinfer.kernels.registry import op

__all__ = ["indexer_scores", "select_topk"]


@op(reference=ref.indexer_scores)
def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """``I[t, c] = sum_h weights[t, h] * relu(q[t, h] . keys[candidates[t, c]])`` in fp32.

    q:          ``[T, Hi, d]`` indexer queries (RoPE'd; any float dtype).
    weights:    ``[T, Hi]`` per-head weights, already scaled (``d^-1/2 Hi^-1/2``).
    keys:       ``[M, d]`` the indexer key rows (a flattened paged arena).
    candidates: ``[T, C]`` int rows of ``keys`` each query may pick; ``-1`` = padding.
    Returns ``[T, C]`` fp32, ``-inf`` at padding.
    """


@op(reference=ref.select_topk)
def select_topk(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The candidate values of the ``k`` highest scores of each row.

    scores: ``[T, C]`` fp32 (``-inf`` = not selectable); candidates ``[T, C]`` int.
    Returns ``[T, k]`` int64 candidate values, ``-1`` where fewer than ``k`` finite scores
    exist. Order within a row is unspecified (attention does not depend on it).
    """
