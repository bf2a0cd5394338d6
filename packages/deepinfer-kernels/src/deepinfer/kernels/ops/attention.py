"""Sparse multi-query attention over per-query index lists (DESIGN.md section 5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.kernels.formats import PackedRows
from deepinfer.kernels.reference import attention as ref
from deepinfer.kernels.registry import op

__all__ = ["join_index_lists", "sparse_mqa_sink"]


@op(reference=ref.sparse_mqa_sink)
def sparse_mqa_sink(
    q: torch.Tensor,
    kv: torch.Tensor | PackedRows | Sequence[torch.Tensor | PackedRows],
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One shared K=V head attended by every query head, over the rows each query lists.

    q:       ``[T, H, D]`` fp32 / bf16, one row per query token.
    kv:      ``[M, D]`` float: the key and value rows; or a tuple / list of up to three
             ``[M_i, D]`` sources (window rings, this step's tokens, compressed entries), each
             a float tensor or :class:`~deepinfer.kernels.PackedRows` (cache rows in the
             model's format, dequantised exactly on read), read in place: row ``r`` of the
             sources is row ``r - M_0 - ..`` of the source it falls in (their virtual
             concatenation, never materialised).
    indices: ``[T, K]`` int32 / int64 rows of ``kv`` query ``t`` attends to (``< sum M_i``);
             ``-1`` = skip. Order is irrelevant; duplicates count twice.
    sink:    ``[H]`` fp32 per-head sink logit: an extra logit with a zero value vector.
    For each (t, h): ``l_i = scale * q[t,h] . kv[idx_i]`` over valid i (fp32);
    ``out = sum_i exp(l_i - M) kv[idx_i] / (sum_i exp(l_i - M) + exp(sink_h - M))``.
    A query with no valid index returns zeros. Returns ``[T, H, D]`` of ``q.dtype``.
    """


@op(reference=ref.join_index_lists)
def join_index_lists(first: torch.Tensor, second: torch.Tensor, offset: int) -> torch.Tensor:
    """One ``[T, A + B]`` index list for :func:`sparse_mqa_sink` from two: ``first`` ``[T, A]``
    as it is, then ``second`` ``[T, B]`` with ``offset`` added to its entries ``>= 0`` (``-1``
    stays a hole), in ``first``'s integer dtype (attention's window lists, then its compressed
    entries' rows moved past the window and step sources)."""
