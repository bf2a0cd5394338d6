"""Sizing the KV cache from device memory after a profile run (plain arithmetic).

The runner measures, after one profile step at the configured ``max_num_seqs`` and
``max_num_batched_tokens``, the peak memory in use (weights + activations + anything else),
and the bytes one arena block and one state slot take across all layers. Then::

    budget     = total_memory * gpu_memory_utilization - peak_memory
    slots      = max_num_seqs + 1                       (slot 0 reserved)
    num_blocks = (budget - slots * bytes_per_state_slot) // bytes_per_block   (block 0 reserved)

On a GPU, ``peak_memory`` is this engine's own use (:func:`device_peak_bytes`): the memory this
process's allocator held before the engine loaded, what the device's free memory fell by while
it loaded, the profiled activations and the graphs' pools. As in vLLM, memory other processes
hold does not count against the engine's share, but the cache never takes more than the device
has free (less a 1 GiB headroom).
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = float(1 << 30)
HEADROOM_BYTES = 1 << 30  # left free on the device when its free memory bounds the cache


@dataclass(frozen=True)
class CacheCapacity:
    """Cache size in ids (reserved id 0 included in both counts)."""

    num_blocks: int
    num_state_slots: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_sequences(self) -> int:
        return self.num_state_slots - 1

    def describe(self) -> str:
        return (
            f"{self.num_tokens} tokens ({self.num_blocks - 1} blocks of {self.block_size}), "
            f"{self.num_sequences} sequences"
        )


def plan_cache_capacity(
    *,
    total_memory_bytes: int,
    peak_memory_bytes: int,
    gpu_memory_utilization: float,
    bytes_per_block: int,
    bytes_per_state_slot: int,
    max_num_seqs: int,
    block_size: int,
) -> CacheCapacity:
    """How many blocks and state slots fit (see the module docstring).

    Raises ``ValueError`` with the numbers when not even one usable block fits.
    """
    if bytes_per_block <= 0 or bytes_per_state_slot < 0:
        raise ValueError(
            f"bytes_per_block={bytes_per_block}, bytes_per_state_slot={bytes_per_state_slot}: "
            "expected a positive block size and a non-negative slot size"
        )
    num_state_slots = max_num_seqs + 1
    budget = int(total_memory_bytes * gpu_memory_utilization) - peak_memory_bytes
    for_blocks = budget - num_state_slots * bytes_per_state_slot
    num_blocks = for_blocks // bytes_per_block if for_blocks > 0 else 0
    if num_blocks < 2:
        raise ValueError(
            f"no room for the KV cache: {gpu_memory_utilization:.0%} of "
            f"{total_memory_bytes / _GIB:.2f} GiB minus {peak_memory_bytes / _GIB:.2f} GiB in use "
            f"leaves {budget / _GIB:.2f} GiB, and {num_state_slots} state slots take "
            f"{num_state_slots * bytes_per_state_slot / _GIB:.2f} GiB; a block needs "
            f"{bytes_per_block / _GIB:.4f} GiB. Raise gpu_memory_utilization, lower max_num_seqs, "
            "or free the device memory other processes hold (the cache never takes more than is "
            "free)"
        )
    return CacheCapacity(num_blocks, num_state_slots, block_size)


def device_peak_bytes(
    *,
    total_bytes: int,
    free_bytes: int,
    free_before_load_bytes: int,
    held_before_load_bytes: int,
    activation_bytes: int,
    reserve_bytes: int,
    gpu_memory_utilization: float,
) -> int:
    """``peak_memory_bytes`` for :func:`plan_cache_capacity` on a device other processes may
    share: this engine's own use (``held_before_load_bytes``, what this process's allocator
    held before loading, plus the drop in free memory since then, the profiled activations and
    ``reserve_bytes`` for the graphs), raised where needed so that the budget never exceeds the
    device's free memory less the activations, the reserve and :data:`HEADROOM_BYTES`."""
    dropped = max(free_before_load_bytes - free_bytes, 0)
    own = held_before_load_bytes + dropped + activation_bytes + reserve_bytes
    room = free_bytes - activation_bytes - reserve_bytes - HEADROOM_BYTES
    return max(own, int(total_bytes * gpu_memory_utilization) - room)
