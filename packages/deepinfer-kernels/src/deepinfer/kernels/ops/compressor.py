"""KV compression: one entry per window, a per-channel softmax pool over the window's rows."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import compressor as ref
from deepinfer.kernels.registry import op

__all__ = ["compress_gather_pool", "compress_pool", "write_state_rows"]


@op(reference=ref.compress_pool)
def compress_pool(
    kv: torch.Tensor, score: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``entry[e, d] = sum_l softmax_l(score[e, :, d]) kv[e, l, d]`` in fp32.

    kv:    ``[E, L, d]`` the projected rows of each window (``L = ratio``, or ``2 ratio`` for
           the overlapped ratio-4 compressor: previous window's first half, then this one's
           second half), any float dtype.
    score: ``[E, L, d]`` fp32 gate logits, position bias already added; ``-inf`` marks a slot
           that does not exist (weight 0; its kv must be finite). Each (e, d) needs one finite
           score. Returns ``[E, d]`` of ``out_dtype``: the fp32 result, rounded once (to
           nearest even) when ``out_dtype`` is narrower, as ``.to`` does.
    """


@op(reference=ref.compress_gather_pool)
def compress_gather_pool(
    first_kv: torch.Tensor,
    first_score: torch.Tensor,
    second_kv: torch.Tensor,
    second_score: torch.Tensor,
    rows: torch.Tensor,
    *,
    overlap: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`compress_pool` of windows gathered from two row sources, in one call.

    The rows of ``[first | second]`` (a compressor's state pool of ``S = first_kv.shape[0]``
    rows, then the step's projected rows) make each window: ``rows [E, L]`` integer, row ``r <
    S`` is ``first[r]``, ``r >= S`` is ``second[r - S]``, ``-1`` a slot that does not exist
    (weight 0). ``*_kv`` and ``*_score`` are ``[S or T, C]`` of any float dtypes (a bf16
    step beside an fp32 pool, say), the scores with the position bias already added; the two
    sources are read in their promoted dtype (widening is exact). Without ``overlap`` the
    window's slot ``l`` is the whole ``C``-wide row; with ``overlap`` (V4's ratio-4 compressor,
    ``L = 2 ratio``, ``C = 2 d``) slots ``l < ratio`` take the row's first ``d`` columns and the
    others its last ``d``. Returns ``[E, d]`` (``d = C`` without overlap) of ``out_dtype``:
    exactly :func:`compress_pool` of the gathered ``[E, L, d]`` windows, ``-inf`` scores in the
    missing slots. Each (e, d) needs one existing slot.
    """


@op(reference=ref.write_state_rows)
def write_state_rows(
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    dst: torch.Tensor,
    kv: torch.Tensor,
    score: torch.Tensor,
    src: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A compressor's partial windows kept for the next step, in one call: ``state_kv[dst[i]] =
    kv[src[i]]`` and ``state_score[dst[i]] = score[src[i]]`` for every ``i``, in place.

    ``state_*`` ``[S, C]``, ``kv`` / ``score`` ``[T, C]`` of any float dtypes, cast to the
    state's; ``dst``, ``src``
    integer ``[n]``, ``dst`` distinct in ``[0, S)``, ``src`` in ``[0, T)``. The other state rows
    are untouched. Returns ``(state_kv, state_score)``.
    """
