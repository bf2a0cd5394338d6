from __future__ import annotations

import pytest
import torch

from deepinfer.parallel import (
    ExpertLoadWindow,
    ExpertPlacement,
    align_slots,
    imbalance,
    initial_placement,
    rank_loads,
    rebalance,
    route_to_slots,
    weight_moves,
)


def zipf_routing(num_experts: int, top_k: int, num_tokens: int, seed: int) -> torch.Tensor:
    """``[T, K]`` distinct experts per token, expert e drawn with weight 1 / (e + 1): the hot
    experts cluster in the low ids, i.e. on rank 0 of the contiguous placement, as real routing
    concentrates on a few experts that a contiguous split happens to put together."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    return torch.multinomial(weights.expand(num_tokens, -1), top_k, generator=gen)


def test_load_window_counts_and_wraps():
    gen = torch.Generator().manual_seed(1)
    window = ExpertLoadWindow(num_experts=10, window=3)
    steps = [torch.randint(0, 10, (5 + i, 2), generator=gen) for i in range(7)]
    steps[6][0, 0] = -1  # padding is not counted
    for i, ids in enumerate(steps):
        window.record(ids)
        expected = [torch.bincount(s[s >= 0], minlength=10) for s in steps[max(0, i - 2) : i + 1]]
        expected += [torch.zeros(10, dtype=torch.int64)] * (3 - len(expected))
        assert torch.equal(window.load(), torch.stack(expected))
    assert window.num_steps == 7


def test_load_window_record_does_not_read_the_device(monkeypatch):
    def host_read(*args, **kwargs):
        raise AssertionError("host sync in record()")

    window = ExpertLoadWindow(num_experts=8, window=4)
    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    window.record(torch.tensor([[1, 2], [2, 7]]))
    monkeypatch.undo()
    assert window.load()[0].tolist() == [0, 1, 2, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("ep_size,top_k", [(8, 8), (4, 6)])
def test_eplb_acceptance_on_zipf_routing(ep_size, top_k):
    num_experts, num_tokens = 256, 4096
    topk_ids = zipf_routing(num_experts, top_k, num_tokens, seed=ep_size)
    load = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    baseline = imbalance(rank_loads(load, initial_placement(num_experts, ep_size)))
    assert baseline >= 2.0

    placement = rebalance(load, ep_size, num_experts // ep_size + 1)
    assert imbalance(rank_loads(load, placement)) <= 1.10
    # the tokens actually routed by key, not only the even-spread model, are balanced too
    slots = route_to_slots(topk_ids, placement.to_tensors(), torch.arange(num_tokens) * 7919)
    per_rank = torch.bincount(slots.flatten() // placement.slots_per_rank, minlength=ep_size)
    assert imbalance(per_rank) <= 1.10

    window = ExpertLoadWindow(num_experts, window=16)
    for chunk in topk_ids.chunk(16):
        window.record(chunk)
    from_window = rebalance(window.load(), ep_size, num_experts // ep_size + 1)
    assert imbalance(rank_loads(load, from_window)) <= 1.10


def test_rebalance_invariants_and_determinism():
    gen = torch.Generator().manual_seed(3)
    load = torch.randint(0, 50, (64,), generator=gen)
    load[[5, 9]] = 5000  # two hot experts
    placement = rebalance(load, ep_size=4, slots_per_rank=17)
    assert placement == rebalance(load.clone(), ep_size=4, slots_per_rank=17)
    assert all(len(row) == 17 for row in placement.slot_expert)
    counts = [len(placement.replicas(e)) for e in range(64)]
    assert sum(counts) == 68 and min(counts) == 1
    assert counts[5] == 3 and counts[9] == 3  # the four redundant slots go to the hot experts
    for expert in (5, 9):
        ranks = [slot // 17 for slot in placement.replicas(expert)]
        assert len(set(ranks)) == len(ranks)  # replicas of one expert on distinct ranks


def test_rebalance_with_history_weighs_bursts():
    # expert 1 has the larger total, expert 0 all its load in one step: with the per-step
    # history the redundant slot splits the burst, with totals it goes to expert 1
    steps = torch.full((4, 8), 10)
    steps[:, 1] = 110
    steps[:, 0] = torch.tensor([0, 0, 400, 0])
    assert len(rebalance(steps, ep_size=1, slots_per_rank=9).replicas(0)) == 2
    assert len(rebalance(steps.sum(0), ep_size=1, slots_per_rank=9).replicas(1)) == 2


def test_imbalance_is_max_over_mean():
    assert imbalance(torch.tensor([1, 3])) == 1.5
    assert imbalance(torch.zeros(4)) == 1.0


def test_rank_loads_matches_a_loop():
    gen = torch.Generator().manual_seed(4)
    placement = rebalance(torch.randint(1, 100, (16,), generator=gen), 4, 5)
    load = torch.randint(0, 1000, (16,), generator=gen)
    expected = [
        sum(load[e].item() / len(placement.replicas(e)) for e in placement.local_experts(r))
        for r in range(4)
    ]
    assert torch.allclose(rank_loads(load, placement), torch.tensor(expected, dtype=torch.float64))


def apply_moves(old: ExpertPlacement, moves) -> tuple[tuple[int, ...], ...]:
    table = [list(row) for row in old.slot_expert]
    for dst_rank, dst_slot, src_rank, src_slot in moves:  # sources read from the old table
        table[dst_rank][dst_slot] = old.slot_expert[src_rank][src_slot]
    return tuple(tuple(row) for row in table)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weight_moves_turn_old_into_new(seed):
    gen = torch.Generator().manual_seed(seed)
    old = initial_placement(32, 4, 2)
    new = rebalance(torch.randint(0, 1000, (32,), generator=gen) ** 2, 4, 10, previous=old)
    moves = weight_moves(old, new)
    assert apply_moves(old, moves) == new.slot_expert
    changed = sum(a != b for o, n in zip(old.slot_expert, new.slot_expert) for a, b in zip(o, n))
    assert len(moves) == changed
    unaligned = rebalance(torch.randint(0, 1000, (32,), generator=gen) ** 2, 4, 10)
    assert apply_moves(old, weight_moves(old, unaligned)) == unaligned.slot_expert


def test_weight_moves_reuse_a_local_copy_first():
    old = ExpertPlacement(4, 2, 3, ((0, 1, 2), (2, 3, 0)))
    new = ExpertPlacement(4, 2, 3, ((1, 0, 3), (2, 3, 0)))
    assert weight_moves(old, new) == [(0, 0, 0, 1), (0, 1, 0, 0), (0, 2, 1, 1)]
    assert align_slots(old, new).slot_expert == ((0, 1, 3), (2, 3, 0))
    assert weight_moves(old, align_slots(old, new)) == [(0, 2, 1, 1)]
