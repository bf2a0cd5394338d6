"""Per-sequence Engram n-gram history and the n-gram windows of a flat batch (V4.1, spec 7.3).

The n-gram of token ``t`` reads the compressed ids of positions ``t, t-1, ..., t-(N-1)``. A
position before the sequence start, or an image token, is a *barrier*: it and everything behind
it reads as the pad token's compressed id (the look-back latches at the first barrier).

Tokens of the same sequence earlier in the batch are read from the batch; older ones from the
sequence's *history ring* in its state slot: ``history[slot, pos % R]`` holds the compressed id
at ``pos`` (``BARRIER`` = -1 for image tokens or never written). Because entries are keyed by
position, rejected draft tokens need no undo: the next step reads only positions below its
first token, which rejected tokens cannot have overwritten as long as
``R >= (N - 1) + max_rollback_tokens`` (see :func:`history_ring_size`). A new sequence's ring
is filled with ``BARRIER`` (:func:`reset_history`).
"""

from __future__ import annotations

import torch

BARRIER = -1


def history_ring_size(max_ngram_size: int, max_rollback_tokens: int) -> int:
    """Ring length that survives rolling back up to ``max_rollback_tokens`` tokens."""
    if max_ngram_size < 2 or max_rollback_tokens < 0:
        raise ValueError(
            f"max_ngram_size={max_ngram_size}, max_rollback_tokens={max_rollback_tokens}: "
            "expected >= 2 and >= 0"
        )
    return max_ngram_size - 1 + max_rollback_tokens


def new_history(num_slots: int, ring_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_slots, ring_size]`` int64 rings, all ``BARRIER``."""
    return torch.full((num_slots, ring_size), BARRIER, dtype=torch.int64, device=device)


def reset_history(history: torch.Tensor, slots: torch.Tensor) -> None:
    """Clear the rings of ``slots`` (``[n]`` int64) for new sequences, in place."""
    history[slots] = BARRIER


def _lookback_values(
    compressed: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    history: torch.Tensor,
    shift: int,
) -> torch.Tensor:
    """``[T]`` compressed id (or ``BARRIER``) at position ``pos - shift`` of each token."""
    num_tokens = compressed.shape[0]
    source = positions - shift
    earlier = torch.arange(num_tokens, device=compressed.device) - shift
    safe = earlier.clamp_min(0)
    in_batch = (earlier >= 0) & (slots[safe] == slots) & (positions[safe] == source)
    ring = history[slots, source.remainder(history.shape[1])]
    values = torch.where(in_batch, compressed[safe], ring)
    return torch.where(source >= 0, values, torch.full_like(values, BARRIER))


def ngram_token_ids(
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    token_map: torch.Tensor,
    history: torch.Tensor,
    pad_token_id: int,
    max_ngram_size: int,
    is_barrier: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compressed n-gram window of every token of a flat batch; reads, never writes.

    token_ids, positions, slots: ``[T]`` int64; a sequence's tokens in the batch are contiguous
    with consecutive positions (a prefill chunk, a decode token, or [last token, drafts]).
    token_map: ``[vocab]`` int64 compressed token map; history: ``[num_slots, R]`` int64 rings.
    is_barrier: optional ``[T]`` bool (image tokens).
    Returns ``[T, max_ngram_size]`` int64; column ``k`` = compressed id ``k`` positions back,
    barrier-latched to ``token_map[pad_token_id]``.
    """
    compressed = own_history_values(token_ids, token_map, is_barrier)
    pad = token_map[pad_token_id]
    blocked = torch.zeros_like(compressed, dtype=torch.bool)
    columns = []
    for shift in range(max_ngram_size):
        values = _lookback_values(compressed, positions, slots, history, shift)
        blocked = blocked | (values == BARRIER)
        columns.append(torch.where(blocked, pad, values))
    return torch.stack(columns, -1)


def own_history_values(
    token_ids: torch.Tensor, token_map: torch.Tensor, is_barrier: torch.Tensor | None
) -> torch.Tensor:
    """``[T]`` what each token contributes to the history: its compressed id or ``BARRIER``."""
    compressed = token_map[token_ids]
    if is_barrier is None:
        return compressed
    return torch.where(is_barrier, torch.full_like(compressed, BARRIER), compressed)


def last_writers(cells: torch.Tensor, num_cells: int) -> torch.Tensor:
    """``[T]``: for each token, the batch row whose write to the same cell wins (the latest).

    cells ``[T]`` int64 in ``[0, num_cells)``. Writing ``values[last_writers(cells)]`` to
    ``cells`` makes every duplicate write the same value, so the result is deterministic on any
    device without a host sync (no boolean-mask indexing). Assumes later rows of a cell hold
    later positions, as they do for a sequence's contiguous run in a flat batch.
    """
    rows = torch.arange(cells.shape[0], device=cells.device)
    winner = torch.full((num_cells,), -1, dtype=torch.int64, device=cells.device)
    winner = winner.scatter_reduce(0, cells, rows, reduce="amax")
    return winner[cells]


def update_history(
    history: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    token_map: torch.Tensor,
    is_barrier: torch.Tensor | None = None,
) -> None:
    """Write the batch's tokens into their sequences' rings (after :func:`ngram_token_ids`).

    When a chunk is longer than the ring, the latest position of each ring entry wins.
    """
    ring_size = history.shape[1]
    values = own_history_values(token_ids, token_map, is_barrier)
    cells = slots * ring_size + positions.remainder(ring_size)
    flat = history.view(-1)
    flat[cells] = values[last_writers(cells, flat.shape[0])]
