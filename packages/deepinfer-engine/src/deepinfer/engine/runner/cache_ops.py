"""Whole-block and whole-slot operations on a :class:`ModelCache` (copy on write, forks, reset).

The arena tensors (``cache.is_arena``) hold ``rows / num_blocks`` rows per block; every other
cache tensor holds ``rows / num_slots`` rows per state slot (the Engram history in
``cache.extra`` included). The scheduler's block manager decides the ids; these
functions move the bytes.
"""

from __future__ import annotations

import torch

from deepinfer.engine.model.cache import ModelCache


def _rows(t: torch.Tensor, count: int, index: int) -> slice:
    per = t.shape[0] // count
    return slice(index * per, (index + 1) * per)


def _slot_tensors(cache: ModelCache) -> list[torch.Tensor]:
    slots = [t for k, t in cache.tensors.items() if not cache.is_arena(k)]
    return slots + list(cache.extra.values())


def copy_blocks(cache: ModelCache, copies: list[tuple[int, int]]) -> None:
    """Copy whole arena blocks ``src -> dst`` in every layer that owns an arena."""
    n = cache.layout.num_blocks
    for src, dst in copies:
        for key, t in cache.tensors.items():
            if cache.is_arena(key):
                t[_rows(t, n, dst)] = t[_rows(t, n, src)]


def copy_slots(cache: ModelCache, copies: list[tuple[int, int]]) -> None:
    """Copy whole state slots ``src -> dst`` (window rings, compressor state, Engram history)."""
    n = cache.layout.num_slots
    for src, dst in copies:
        for t in _slot_tensors(cache):
            t[_rows(t, n, dst)] = t[_rows(t, n, src)]


def reset_slot(cache: ModelCache, slot: int) -> None:
    """Return a state slot to its initial contents (a new sequence starts clean)."""
    reset_slots(cache, [slot])


def reset_slots(cache: ModelCache, slots: list[int]) -> None:
    """Return state slots to their initial contents: one fill per cache tensor and run of
    consecutive slots (a step's new sequences usually hold consecutive slots), not one per
    tensor and slot."""
    if not slots:
        return
    n = cache.layout.num_slots
    runs = _runs(sorted(set(slots)))
    for key, t in cache.tensors.items():
        if not cache.is_arena(key):
            value = float("-inf") if key.endswith("_score") else 0
            for first, last in runs:
                t[_rows(t, n, first).start : _rows(t, n, last).stop] = value
    if "engram_history" in cache.extra:
        from deepinfer.engine.model.engram_history import reset_history

        reset_history(cache.extra["engram_history"], torch.tensor(slots))


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as ``(first, last)`` runs of consecutive ids."""
    runs = [[ids[0], ids[0]]]
    for i in ids[1:]:
        if i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]
