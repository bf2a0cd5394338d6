"""The expert permutation: its invariants (every slot once, grouped by expert, stable, unused
blocks marked), and the one-launch kernel against the torch composition."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels_nvidia.moe import align

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_by_expert_groups_every_slot_once(block_m):
    gen = torch.Generator().manual_seed(block_m)
    ids = torch.randint(0, 7, (13, 3), generator=gen)
    layout = align.align_by_expert(ids, 9, block_m)
    slots = layout.row_slot.long()
    real = slots < ids.numel()
    assert sorted(slots[real].tolist()) == list(range(ids.numel()))
    experts_of_rows = layout.block_expert.long().repeat_interleave(block_m)
    assert torch.equal(experts_of_rows[real], ids.reshape(-1)[slots[real]])
    # stable: within an expert, slots keep their token order
    for e in range(9):
        mine = slots[real][experts_of_rows[real] == e]
        assert torch.equal(mine, mine.sort().values)
    assert bool((layout.block_expert[(~real).view(-1, block_m).all(1)] == -1).all())


def _capacity(num_slots, num_experts, block_m):
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m) * block_m


def _check_multi(num_slots, num_experts, block_m, slot_chunk, device):
    gen = torch.Generator().manual_seed(num_slots + slot_chunk)
    ids = torch.randint(0, num_experts, (num_slots,), generator=gen).to(device)
    capacity = _capacity(num_slots, num_experts, block_m)
    row_slot, block_expert = align.align_multi(ids, num_experts, block_m, capacity, slot_chunk)
    want = align._align_by_expert_torch(ids.long(), num_experts, block_m, capacity)
    assert torch.equal(row_slot, want.row_slot)
    assert torch.equal(block_expert, want.block_expert)


@pytest.mark.parametrize(
    ("num_slots", "num_experts", "block_m", "slot_chunk"),
    [(39, 9, 4, 16), (384, 256, 16, 64), (20, 384, 16, 16), (600, 8, 64, 32), (1, 3, 16, 16)],
)
def test_multi_program_alignment_equals_the_torch_composition(
    num_slots, num_experts, block_m, slot_chunk
):
    _check_multi(num_slots, num_experts, block_m, slot_chunk, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("num_slots", "num_experts", "block_m", "slot_chunk"),
    [(384, 256, 16, 64), (384, 384, 16, 64), (2048, 256, 16, 64), (1536, 384, 16, 32),
     (2048, 256, 64, 128), (6, 256, 16, 64)],
)  # fmt: skip
def test_multi_program_alignment_real(num_slots, num_experts, block_m, slot_chunk):
    _check_multi(num_slots, num_experts, block_m, slot_chunk, DEVICE)
