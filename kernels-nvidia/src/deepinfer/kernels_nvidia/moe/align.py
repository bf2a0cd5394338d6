"""The expert permutation: the flat (token, slot) pairs sorted by expert (stable) into row
blocks, with device-side ops only, so it can run inside a CUDA graph.

The torch composition (``_align_by_expert_torch``) costs about fifteen launches, a noticeable
share of a decode step's expert time, so up to ``MAX_SLOTS`` pairs take one launch of
``align_multi`` instead, with the same layout. Its ``cdiv(num_slots, SLOT_CHUNK)`` programs each
recompute the expert histogram and the padded offsets (cheap: every id is in registers), rank
and scatter their own ``SLOT_CHUNK`` slots (comparing them only with the slots before them), and
write the padding rows and the experts of their own share of the row blocks. Real rows are
written only by the scatter and padding rows only by their block's program, so no two programs
write the same row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SLOTS = 2048
MAX_EXPERTS = 1023


@triton.jit
def _padded_offsets(ids_ptr, num_slots, SLOTS_P2: tl.constexpr, EXPERTS_P2: tl.constexpr,
                    BLOCK_M: tl.constexpr):  # fmt: skip
    """Per expert: its slot count and its first row (rows padded to whole ``BLOCK_M`` blocks)."""
    slots = tl.arange(0, SLOTS_P2)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=0).to(tl.int32)
    counts = tl.histogram(ids, EXPERTS_P2, mask=slots < num_slots)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    return counts, padded_end - padded, padded_end


@triton.jit
def _fill_row_blocks(
    experts, padded_end, starts_ptr, counts_ptr, row_slot_ptr, block_expert_ptr, num_slots,
    num_experts, capacity, pid, blocks_per_program,
    BLOCK_M: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):  # fmt: skip
    """Program ``pid``'s share of the row blocks: each block's expert (-1: unused) and the
    padding rows (``num_slots``); ``padded_end`` [EXPERTS_P2] per expert, ``starts_ptr`` /
    ``counts_ptr`` each expert's first row and slot count."""
    real_end = tl.where(experts < num_experts, padded_end, capacity + 1)
    num_blocks = capacity // BLOCK_M
    first_block = pid * blocks_per_program
    for b0 in range(first_block, first_block + blocks_per_program, BLOCK_CHUNK):
        blocks = b0 + tl.arange(0, BLOCK_CHUNK)
        in_range = (blocks < num_blocks) & (blocks < first_block + blocks_per_program)
        first_row = blocks * BLOCK_M
        expert = tl.sum((real_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=in_range)
        has_expert = in_range & (expert >= 0)
        e_start = tl.load(starts_ptr + expert, mask=has_expert, other=0)
        e_count = tl.load(counts_ptr + expert, mask=has_expert, other=0)
        rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        pad = (expert[:, None] < 0) | (rows - e_start[:, None] >= e_count[:, None])
        tl.store(row_slot_ptr + rows, num_slots + rows * 0, mask=in_range[:, None] & pad)


@triton.jit
def moe_align_multi_kernel(
    ids_ptr, row_slot_ptr, block_expert_ptr, scratch_ptr, num_slots, num_experts, capacity,
    blocks_per_program,
    BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr, EXPERTS_P2: tl.constexpr,
    SLOT_CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):  # fmt: skip
    """``ids [num_slots]`` -> ``row_slot [capacity]`` int32 (``num_slots``: padding) and
    ``block_expert [capacity / BLOCK_M]`` int32 (-1: unused), from ``cdiv(num_slots,
    SLOT_CHUNK)`` programs; ``scratch [programs, 2, EXPERTS_P2]`` int32 (each program's own copy
    of the starts and counts)."""
    pid = tl.program_id(0)
    counts, starts, padded_end = _padded_offsets(ids_ptr, num_slots, SLOTS_P2, EXPERTS_P2,
                                                 BLOCK_M)  # fmt: skip
    experts = tl.arange(0, EXPERTS_P2)
    own = scratch_ptr + pid.to(tl.int64) * 2 * EXPERTS_P2
    tl.store(own + experts, starts)
    tl.store(own + EXPERTS_P2 + experts, counts)
    tl.debug_barrier()  # this program's starts and counts before the gathers below
    # this program's slots: rank among the earlier slots of the same expert (stable), scatter
    slots = pid * SLOT_CHUNK + tl.arange(0, SLOT_CHUNK)
    is_slot = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=is_slot, other=0).to(tl.int32)
    rank = tl.zeros((SLOT_CHUNK,), dtype=tl.int32)
    for c0 in range(0, pid * SLOT_CHUNK + SLOT_CHUNK, SLOT_CHUNK):
        others = c0 + tl.arange(0, SLOT_CHUNK)
        other_ids = tl.load(ids_ptr + others, mask=others < num_slots, other=-1).to(tl.int32)
        same = (ids[:, None] == other_ids[None, :]) & (others[None, :] < slots[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    start = tl.load(own + ids, mask=is_slot, other=0)
    tl.store(row_slot_ptr + start + rank, slots, mask=is_slot)
    # this program's row blocks: their expert, and the padding rows
    _fill_row_blocks(
        experts, padded_end, own, own + EXPERTS_P2, row_slot_ptr, block_expert_ptr, num_slots,
        num_experts, capacity, pid, blocks_per_program, BLOCK_M, BLOCK_CHUNK,
    )  # fmt: skip


def align_multi(
    flat_ids: torch.Tensor, num_experts: int, block_m: int, capacity: int, slot_chunk: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_slot, block_expert)`` for ``flat_ids`` (1 to ``MAX_SLOTS`` entries in
    ``[0, num_experts)``, ``num_experts <= MAX_EXPERTS``), ``capacity`` a multiple of ``block_m``,
    from ``cdiv(num_slots, slot_chunk)`` programs."""
    num_slots = flat_ids.numel()
    if not 0 < num_slots <= MAX_SLOTS or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"align_multi: {num_slots} slots / {num_experts} experts, expected 1 to "
            f"{MAX_SLOTS} / at most {MAX_EXPERTS}"
        )
    device = flat_ids.device
    row_slot = torch.empty(capacity, dtype=torch.int32, device=device)
    num_blocks = capacity // block_m
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    experts_p2 = triton.next_power_of_2(num_experts + 1)
    programs = triton.cdiv(num_slots, slot_chunk)
    scratch = torch.empty((programs, 2, experts_p2), dtype=torch.int32, device=device)
    moe_align_multi_kernel[(programs,)](
        flat_ids, row_slot, block_expert, scratch, num_slots, num_experts, capacity,
        triton.cdiv(num_blocks, programs), BLOCK_M=block_m,
        SLOTS_P2=triton.next_power_of_2(max(num_slots, 16)), EXPERTS_P2=experts_p2,
        SLOT_CHUNK=slot_chunk, BLOCK_CHUNK=16, num_warps=4,
    )  # fmt: skip
    return row_slot, block_expert


@dataclass(frozen=True)
class ExpertLayout:
    """Rows grouped by expert: ``row_slot [capacity]`` int32 (``num_slots`` marks padding),
    ``block_expert [capacity / block_m]`` int32 (-1: unused block)."""

    row_slot: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Sort the flat (token, slot) pairs by expert (stable) into ``block_m``-row blocks, with
    device-side ops only (no host sync): one launch (``align_multi``, 32 slots per program) for
    up to ``MAX_SLOTS`` pairs, a torch composition above that."""
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    capacity = (
        triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    )
    if 0 < num_slots <= MAX_SLOTS and num_experts <= MAX_EXPERTS:
        row_slot, block_expert = align_multi(
            flat.contiguous(), num_experts, block_m, capacity, slot_chunk=32
        )
        return ExpertLayout(row_slot, block_expert, block_m)
    return _align_by_expert_torch(flat.to(torch.int64), num_experts, block_m, capacity)


def _align_by_expert_torch(flat, num_experts, block_m, capacity) -> ExpertLayout:
    num_slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    # index_add_, not bincount: bincount reads the maximum back to the host (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = (
        torch.arange(num_slots, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    dest = (padded_end - padded)[sorted_experts] + rank
    row_slot = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    row_slot[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertLayout(row_slot, block_expert, block_m)
