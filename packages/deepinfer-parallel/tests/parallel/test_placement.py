from __future__ import annotations

import pytest
import torch

from deepinfer.parallel import ExpertPlacement, initial_placement, route_to_slots


@pytest.mark.parametrize("num_experts,ep_size,num_redundant", [(256, 8, 1), (16, 4, 2), (8, 2, 5)])
def test_initial_placement_invariants(num_experts, ep_size, num_redundant):
    placement = initial_placement(num_experts, ep_size, num_redundant)
    per_rank = num_experts // ep_size
    assert placement.slots_per_rank == per_rank + num_redundant
    assert placement.num_redundant == num_redundant
    for rank in range(ep_size):
        local = placement.local_experts(rank)
        assert len(local) == placement.slots_per_rank
        assert local[:per_rank] == tuple(range(rank * per_rank, (rank + 1) * per_rank))
    slots = [s for e in range(num_experts) for s in placement.replicas(e)]
    assert sorted(slots) == list(range(ep_size * placement.slots_per_rank))
    assert all(len(placement.replicas(e)) >= 1 for e in range(num_experts))


def test_resident_bytes_are_share_plus_redundant_slots():
    bytes_per_expert = 3 * 1024 * 1024
    placement = initial_placement(256, 8, 1)
    total = 256 * bytes_per_expert
    for rank in range(8):
        assert placement.resident_bytes(rank, bytes_per_expert) == total // 8 + bytes_per_expert
    assert initial_placement(256, 8, 0).resident_bytes(3, bytes_per_expert) == total // 8


def test_tensors_match_the_placement():
    placement = initial_placement(16, 4, 2)
    tables = placement.to_tensors("cpu")
    assert tables.replica_slots.dtype == torch.int64
    for expert in range(16):
        count = int(tables.num_replicas[expert])
        assert tuple(tables.replica_slots[expert, :count].tolist()) == placement.replicas(expert)
        assert (tables.replica_slots[expert, count:] == -1).all()
        for slot in placement.replicas(expert):
            assert int(tables.slot_expert[slot]) == expert


def test_route_to_slots_picks_replicas_and_is_batch_invariant():
    placement = initial_placement(32, 4, 3)
    tables = placement.to_tensors()
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.stack([torch.randperm(32, generator=gen)[:6] for _ in range(64)])
    token_keys = torch.randint(0, 2**62, (64,), generator=gen)
    slots = route_to_slots(topk_ids, tables, token_keys)
    assert slots.shape == (64, 6)
    assert torch.equal(tables.slot_expert[slots], topk_ids)  # only replicas of the routed expert
    for t in range(64):
        alone = route_to_slots(topk_ids[t : t + 1], tables, token_keys[t : t + 1])
        assert torch.equal(alone[0], slots[t])
    replicated = [e for e in range(32) if len(placement.replicas(e)) > 1]
    used = {int(s) for s in slots[topk_ids == replicated[0]]}
    assert len(used) > 1  # tokens spread over an expert's replicas


def test_route_to_slots_maps_padding_to_minus_one():
    tables = initial_placement(8, 2, 1).to_tensors()
    topk_ids = torch.tensor([[3, -1], [-1, 4]])
    slots = route_to_slots(topk_ids, tables, torch.tensor([5, 6]))
    assert slots[0, 1] == -1 and slots[1, 0] == -1
    assert tables.slot_expert[slots[0, 0]] == 3 and tables.slot_expert[slots[1, 1]] == 4


def test_route_to_slots_rejects_mismatched_keys():
    tables = initial_placement(8, 2).to_tensors()
    with pytest.raises(ValueError, match="token_keys"):
        route_to_slots(
            torch.zeros(4, 2, dtype=torch.int64), tables, torch.zeros(3, dtype=torch.int64)
        )


def test_invalid_placements_name_the_field():
    with pytest.raises(ValueError, match="ep_size"):
        initial_placement(10, 4)
    with pytest.raises(ValueError, match="every expert needs a slot"):
        ExpertPlacement(4, 2, 2, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="slot_expert"):
        ExpertPlacement(4, 2, 2, ((0, 1), (2,)))
    with pytest.raises(ValueError, match="rank"):
        initial_placement(8, 2).local_experts(2)
