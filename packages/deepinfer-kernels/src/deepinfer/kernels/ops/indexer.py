"""Lightning indexer: score compressed entries for each query, keep the top k."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import indexer as ref
from deepinfer.kernels.registry import op

__all__ = ["indexer_scores", "select_topk", "candidate_block_mask", "hadamard_rotate"]


@op(reference=ref.indexer_scores)
def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_rows: torch.Tensor,
    q_seq: torch.Tensor,
    counts: torch.Tensor,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """``I[t, c] = sum_h weights[t, h] * relu(q[t, h] . keys[seq_rows[q_seq[t], c]])`` in fp32,
    for the first ``counts[t]`` columns: each query's candidates are a prefix of its
    sequence's list (no ``[T, C]`` index list is needed).

    q:        ``[T, Hi, d]`` indexer queries (RoPE'd; any float dtype).
    weights:  ``[T, Hi]`` per-head weights (any float dtype), each scaled as
              ``fp32(weights) * weight_scale`` in fp32 (``d^-1/2 Hi^-1/2``, or 1.0 when the
              caller scaled them).
    keys:     ``[M, d]`` the indexer key rows (a flattened paged arena), a float tensor or
              :class:`~deepinfer.kernels.PackedRows` (the cache's FP4 rows, dequantised).
    seq_rows: ``[B, C]`` int rows of ``keys`` of each sequence, in entry order; ``-1`` = none.
    q_seq:    ``[T]`` int, the row of ``seq_rows`` each query picks from.
    counts:   ``[T]`` int, the columns each query sees (``c < counts[t]``; may exceed ``C``).
    Returns ``[T, C]`` fp32, ``-inf`` past a query's count and at ``-1``.
    """


@op(reference=ref.select_topk)
def select_topk(
    scores: torch.Tensor, seq_rows: torch.Tensor, q_seq: torch.Tensor, k: int
) -> torch.Tensor:
    """The candidate values ``seq_rows[q_seq[t], c]`` of the ``k`` highest scores of each row.

    scores: ``[T, C]`` fp32 (``-inf`` = not selectable); seq_rows ``[B, C]`` int, q_seq
    ``[T]`` int (as for :func:`indexer_scores`).
    Returns ``[T, k]`` int64 candidate values in descending score order (ties: the lower
    column first), ``-1`` where fewer than ``k`` finite scores exist.
    """


@op(reference=ref.candidate_block_mask)
def candidate_block_mask(
    scores: torch.Tensor, visible_count: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """V4.1 candidate pre-filter: the columns of the ``topk_blocks`` best blocks per query.

    scores: ``[T, C]`` fp32 indexer scores over entries ``0 .. C-1`` (``-inf`` = invisible);
    visible_count ``[T]`` int: entries visible to each query. Blocks are ``block_size``
    consecutive entries scored by their max; the block of the newest visible entry
    (``(count - 1) // block_size``) is always kept; blocks whose score is ``-inf`` never are.
    Returns ``[T, C]`` bool: True for the entries of kept blocks.
    """


@op(reference=ref.hadamard_rotate)
def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform of the last dim (``d`` a power of two):
    ``y = x H_d / sqrt(d)`` in fp32 (Sylvester order). Returns ``x.dtype``."""
