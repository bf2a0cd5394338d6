"""Placement, EPLB and dispatch/combine together over gloo: an EP MoE layer whose ranks hold only
their slots' expert weights gives the single-process output, bitwise, before and after a
rebalance that moves weights between ranks by :func:`move_slots`."""

from __future__ import annotations

import torch

from deepinfer.parallel import (
    ExpertLoadWindow,
    TorchDistributedComm,
    combine,
    dispatch,
    group_by_slot,
    initial_placement,
    move_slots,
    rebalance,
    route_to_slots,
    spawn,
)

NUM_EXPERTS, TOP_K, HIDDEN, NUM_REDUNDANT = 8, 3, 6, 1


def _experts(seed: int) -> torch.Tensor:
    """``[E, 2, D]`` float32: expert e maps x to (x * scale + shift) * x, elementwise and in
    separate exactly rounded ops (no transcendental, whose vector and scalar paths may round
    differently), so a row's output never depends on which rows share its group."""
    return torch.randn(NUM_EXPERTS, 2, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _apply_expert(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (rows * weight[0] + weight[1]) * rows


def _tokens(seed: int, rank: int):
    """Per rank: hidden [T, D], skewed top-k ids [T, K] (expert 0 hottest), weights, keys."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    num_tokens = 40 + 7 * rank
    skew = 1.0 / torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** 2
    topk_ids = torch.multinomial(skew.expand(num_tokens, -1), TOP_K, generator=gen)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    keys = torch.arange(num_tokens) + 1000 * rank
    return hidden, topk_ids, torch.rand(num_tokens, TOP_K, generator=gen), keys


def _reference(hidden, topk_ids, weights, experts) -> torch.Tensor:
    acc = torch.zeros(hidden.shape, dtype=torch.float32)
    for k in range(TOP_K):
        out = torch.stack([_apply_expert(x, experts[e]) for x, e in zip(hidden, topk_ids[:, k])])
        acc += out * weights[:, k, None]
    return acc


def _moe(hidden, topk_ids, weights, keys, placement, local_weights, comm) -> torch.Tensor:
    slots = route_to_slots(topk_ids, placement.to_tensors(), keys)
    received, local_slot, handle = dispatch(hidden, slots, placement.slots_per_rank, comm)
    order, counts = group_by_slot(local_slot, placement.slots_per_rank)
    out = torch.empty_like(received)
    for slot, rows in enumerate(order.split(counts.tolist())):
        out[rows] = _apply_expert(received[rows], local_weights[slot])
    return combine(out, weights, handle, comm)


def _move_weights(old, new, local_weights, comm) -> torch.Tensor:
    """Each rank's slots under ``new``, the changed ones fetched by :func:`move_slots`."""
    row_bytes = local_weights[0].numel() * local_weights.element_size()
    arrived = move_slots(
        old, new, lambda slot: local_weights[slot].reshape(-1).view(torch.uint8), row_bytes, comm
    )
    moved = local_weights.clone()
    for slot, row in arrived.items():
        moved[slot] = row.view(local_weights.dtype).view(local_weights.shape[1:])
    return moved


def _worker(rank: int, world_size: int, seed: int) -> dict:
    comm = TorchDistributedComm()
    experts = _experts(seed)
    placement = initial_placement(NUM_EXPERTS, world_size, NUM_REDUNDANT)
    local_weights = experts[list(placement.local_experts(rank))]  # only this rank's slots
    hidden, topk_ids, weights, keys = _tokens(seed, rank)
    window = ExpertLoadWindow(NUM_EXPERTS, window=4)
    window.record(topk_ids)
    before = _moe(hidden, topk_ids, weights, keys, placement, local_weights, comm)

    load = window.load()
    comm.all_reduce(load)  # every rank sees the global load, so all compute the same placement
    new = rebalance(load, world_size, placement.slots_per_rank, previous=placement)
    local_weights = _move_weights(placement, new, local_weights, comm)
    after = _moe(hidden, topk_ids, weights, keys, new, local_weights, comm)
    return {
        "before": before,
        "after": after,
        "placement": new.slot_expert,
        "local_weights": local_weights,
    }


def test_ep_layer_matches_reference_across_a_rebalance():
    world_size, seed = 2, 5
    results = spawn(_worker, world_size, seed, timeout_s=60)
    experts = _experts(seed)
    placements = {r["placement"] for r in results}
    assert len(placements) == 1  # every rank computed the same placement
    new_table = placements.pop()
    assert new_table != initial_placement(NUM_EXPERTS, world_size, NUM_REDUNDANT).slot_expert
    assert sum(row.count(0) for row in new_table) == 2  # the hottest expert got the extra slots
    for rank, got in enumerate(results):
        hidden, topk_ids, weights, _ = _tokens(seed, rank)
        assert torch.equal(got["before"], _reference(hidden, topk_ids, weights, experts))
        assert torch.equal(got["after"], got["before"])  # the rebalance changes no output
        assert torch.equal(got["local_weights"], experts[list(new_table[rank])])
