"""Balanced ("mirror") context parallelism: which prompt positions each CP rank prefills, and the
attention work that split gives each rank.

Causal attention makes a query's work grow with its position, so a plain split into ``cp`` equal
runs gives the last rank the most work. The mirror split cuts the prompt into ``2 * cp`` equal
pieces and gives rank ``r`` pieces ``r`` and ``2 * cp - 1 - r``: an early and a late piece whose
work sums to about the same for every rank while the work grows linearly. V4's does not quite:
the window and the top-k selection saturate early in the prompt, so the rank holding the first
piece falls short (by more than 10% at 32k tokens over 8 ranks). :func:`balanced_split`
therefore cuts finer pieces and deals them by counted work, keeping every rank's token count
equal (the dense layers' work is per token). This module is the pure arithmetic of the split;
the engine exchanges the keys each rank needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionShape:
    """What one query's attention costs depend on, per layer: the sliding window, each layer's
    compression ratio (0 = window only), the top-k of the ratio-4 (CSA) layers and the head sizes
    of attention (one shared K=V head read by ``heads`` query heads) and of the indexer."""

    window: int
    compress_ratios: tuple[int, ...]
    index_topk: int
    heads: int
    head_dim: int
    index_heads: int
    index_head_dim: int
    csa_ratio: int = 4


def mirror_pieces(num_tokens: int, cp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per CP rank, its two ``(start, end)`` position ranges of a ``num_tokens`` prompt.

    The prompt is cut into ``2 * cp`` pieces of ``ceil(num_tokens / (2 * cp))`` positions (the
    last pieces are shorter or empty when that does not divide); rank ``r`` takes pieces ``r``
    and ``2 * cp - 1 - r``."""
    bounds = _piece_bounds(num_tokens, 2 * cp, cp)
    piece = [(bounds[i], bounds[i + 1]) for i in range(2 * cp)]
    return [(piece[r], piece[2 * cp - 1 - r]) for r in range(cp)]


def rank_positions(num_tokens: int, cp: int, rank: int) -> torch.Tensor:
    """The prompt positions CP rank ``rank`` prefills, ascending (int64)."""
    (a0, a1), (b0, b1) = mirror_pieces(num_tokens, cp)[rank]
    return torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])


def balanced_split(
    num_tokens: int, cp: int, shape: AttentionShape, rounds: int = 8
) -> list[torch.Tensor]:
    """Per CP rank, the ascending prompt positions it prefills.

    The prompt is cut into ``2 * cp * rounds`` equal pieces (the last ones shorter or empty when
    that does not divide); pieces go, most work first, to the rank with the least work among
    those holding fewer than ``2 * rounds`` pieces (ties: the lower rank). With ``rounds=1``
    this deals exactly the mirror pairs of :func:`mirror_pieces`."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least 1")
    count = 2 * cp * rounds
    bounds = _piece_bounds(num_tokens, count, cp)
    pieces = [torch.arange(bounds[i], bounds[i + 1]) for i in range(count)]
    work = [attention_flops(p, shape) for p in pieces]
    load, held = [0] * cp, [[] for _ in range(cp)]
    for i in sorted(range(count), key=lambda i: (-work[i], -i)):
        rank = min((r for r in range(cp) if len(held[r]) < 2 * rounds), key=lambda r: load[r])
        load[rank] += work[i]
        held[rank].append(i)
    return [torch.cat([pieces[i] for i in sorted(h)]) for h in held]


def _piece_bounds(num_tokens: int, count: int, cp: int) -> list[int]:
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp}: expected at least 1")
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens}: expected at least 0")
    size = -(-num_tokens // count) if num_tokens else 0
    return [min(i * size, num_tokens) for i in range(count + 1)]


def attention_flops(positions: torch.Tensor, shape: AttentionShape) -> int:
    """Multiply-add FLOPs (2 per product) of sparse attention and the indexer for queries at
    ``positions``, summed over the layers.

    A query at position ``p`` reads ``min(window, p + 1)`` window rows in every layer; in a
    ratio-``csa_ratio`` layer also ``min(index_topk, (p + 1) // ratio)`` selected compressed
    entries, after the indexer scored all ``(p + 1) // ratio`` visible ones; in any other
    compressed layer all ``(p + 1) // ratio`` visible entries. Each attended row costs a QK and a
    PV product over ``head_dim`` for each of ``heads``; each scored entry a product over
    ``index_head_dim`` for each of ``index_heads``."""
    p = torch.as_tensor(positions, dtype=torch.int64)
    window_rows = int((p + 1).clamp(max=shape.window).sum())
    per_row = 2 * 2 * shape.heads * shape.head_dim
    per_score = 2 * shape.index_heads * shape.index_head_dim
    total = 0
    for ratio in shape.compress_ratios:
        entries = 0
        scored = 0
        if ratio:
            visible = (p + 1) // ratio
            if ratio == shape.csa_ratio:
                entries = int(visible.clamp(max=shape.index_topk).sum())
                scored = int(visible.sum())
            else:
                entries = int(visible.sum())
        total += per_row * (window_rows + entries) + per_score * scored
    return total


def rank_attention_flops(num_tokens: int, cp: int, shape: AttentionShape) -> list[int]:
    """:func:`attention_flops` of each CP rank's positions under :func:`balanced_split`."""
    return [attention_flops(p, shape) for p in balanced_split(num_tokens, cp, shape)]


def check_context_parallel(
    cp: int, world_size: int, compress_ratios: Sequence[int] | None = None
) -> None:
    """Refuse a CP layout that cannot run, with one line naming the field: ``cp`` must divide the
    ranks, and the model must have compressed attention (the keys the ranks exchange;
    ``compress_ratios`` None: the model is not known yet, only the ranks are checked)."""
    if isinstance(cp, bool) or not isinstance(cp, int):
        raise ValueError(f"context_parallel_size: expected an int >= 1, got {cp!r}")
    if cp < 1:
        raise ValueError(f"context_parallel_size={cp}: expected at least 1")
    if world_size % cp:
        raise ValueError(
            f"context_parallel_size={cp}: expected a divisor of the {world_size} ranks "
            "(data_parallel_size; each group of that many ranks prefills a long prompt together)"
        )
    if cp > 1 and compress_ratios is not None and not any(compress_ratios):
        raise ValueError(
            f"context_parallel_size={cp}: this model has no compressed-attention layer "
            "(every compress ratio is 0), so there is nothing to split a prompt's prefill over"
        )
