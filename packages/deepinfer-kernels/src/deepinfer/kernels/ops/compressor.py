"""KV compression: one entry per window, a per-channel softmax pool over the window's rows."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import compressor as ref
from deepinfer.kernels.registry import op

__all__ = ["compress_pool"]


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
