"""Integer allocator of per-sequence state slots.

A state slot holds what does not grow with the sequence: each attention layer's sliding-window
ring (window + the longest draft, so rejected drafts can roll back), the compressors' partial
windows and the Engram n-gram history. The model owns the tensors; this pool only hands out
slot ids. Slot 0 is reserved as the padding target (CUDA-graph padding rows point at it).
"""

from __future__ import annotations

NULL_STATE_SLOT = 0


class StateSlotPool:
    """Slot ids ``1 .. num_slots - 1``; the lowest free id is handed out first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: expected >= 2 (slot 0 is reserved)")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # stack: pop() gives the lowest id
        self._in_use: set[int] = set()

    @property
    def num_usable_slots(self) -> int:
        return self.num_slots - 1

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_new_slots: int = 1) -> bool:
        return num_new_slots <= len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._in_use:
            raise ValueError(f"state slot {slot} is not allocated")
        self._in_use.remove(slot)
        self._free.append(slot)
        # keep the lowest id on top so reuse is deterministic and compact
        self._free.sort(reverse=True)
