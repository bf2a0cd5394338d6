"""The window lists of a step, ``[T, window]`` rows of ``[ring rows of all slots | the step's
tokens]`` (one column per key position, oldest first), formed on the lists' device from a few
numbers a query row; and, for a prefill-sized step that reads its cache rows as float copies,
the ring rows those lists name, found per sequence on the host."""

from __future__ import annotations

import torch


def named_ring_rows(positions, seq_of_query, starts, slots, window: int, ring_size: int, max_reads):
    """The sorted ring rows the window lists name, or None when they are more than
    ``max_reads``; per sequence, not per list entry: the positions before the sequence's step
    that its lowest query's window reaches, in its slot's ring (fewer than ``window`` of them,
    so no two share a ring row)."""
    lowest = torch.full_like(starts, torch.iinfo(torch.long).max)
    lowest = lowest.scatter_reduce(0, seq_of_query, positions, "amin")
    parts = []
    for low, start, slot in zip(lowest.tolist(), starts.tolist(), slots.tolist()):
        first = max(0, low - window + 1)
        if first < start:
            parts.append(slot * ring_size + torch.arange(first, start) % ring_size)
    rows = torch.cat(parts).sort().values if parts else torch.zeros(0, dtype=torch.long)
    return rows if len(rows) <= max_reads else None


def ring_indices(window_rows: torch.Tensor, ring_rows: torch.Tensor, base: int) -> torch.Tensor:
    """The window lists into ``[ring_rows | step rows]``: a ring row becomes its index in the
    sorted ``ring_rows``, a step row moves down to follow them, -1 stays (on the lists'
    device, elementwise)."""
    shifted = torch.where(window_rows >= base, window_rows - (base - len(ring_rows)), window_rows)
    if not len(ring_rows):
        return shifted
    in_ring = (window_rows >= 0) & (window_rows < base)
    return torch.where(in_ring, torch.searchsorted(ring_rows, window_rows), shifted)


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """The key position of each column of the window lists ``[T, window]``, oldest first."""
    return positions[:, None] - window + 1 + torch.arange(window, device=positions.device)


def window_lists(facts: torch.Tensor, window: int, base: int, ring_size: int) -> torch.Tensor:
    """The window lists ``[T, window]`` from ``facts`` ``[4, T]`` (each query row's position,
    its sequence's first step position, first step row and state slot), on their device."""
    positions, start, first, slot = facts
    return state_or_step(window_positions(positions, window), start, first, slot, base, ring_size)


def state_or_step(q, start, first, slot, base: int, state_rows: int) -> torch.Tensor:
    """Row of position ``q`` ``[N, W]`` in ``[state rows of all slots | step tokens]``: a step
    token when ``q`` is in this step, else the state ring of the sequence's slot; -1 before 0
    (``start``, ``first``, ``slot`` ``[N]``: the sequence's first step position, first step
    row and state slot)."""
    start = start[:, None]
    in_step = base + first[:, None] + q - start
    in_state = slot[:, None] * state_rows + q % state_rows
    return torch.where(q >= start, in_step, in_state).masked_fill(q < 0, -1)
