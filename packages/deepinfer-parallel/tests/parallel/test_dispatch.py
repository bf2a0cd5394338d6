"""MoE dispatch/combine across gloo processes against a single-process reference of all ranks."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel.comm import SingleProcessComm, TorchDistributedComm
from deepinfer.parallel.dispatch import combine, dispatch, group_by_slot
from deepinfer.parallel.launch import spawn

HIDDEN, TOP_K, SLOTS_PER_RANK = 8, 3, 2
DTYPES = (torch.float32, torch.bfloat16)


def _make_inputs(seed: int, world_size: int, dtype: torch.dtype, empty_rank: int | None):
    """Per rank (hidden [T, D], global_slot [T, K], topk_weights [T, K]).

    T is random per rank (0 on ``empty_rank``); slots repeat and about 1 in 5 is padding (-1).
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for rank in range(world_size):
        num_tokens = 0 if rank == empty_rank else int(torch.randint(1, 7, (1,), generator=gen))
        hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
        slots = torch.randint(0, SLOTS_PER_RANK * world_size, (num_tokens, TOP_K), generator=gen)
        padding = torch.rand(num_tokens, TOP_K, generator=gen) < 0.2
        slots = torch.where(padding, -1, slots)  # padding pairs (slot -1) add nothing
        weights = torch.rand(num_tokens, TOP_K, generator=gen)
        inputs.append((hidden, slots, weights))
    return inputs


def _fake_expert(rows: torch.Tensor, global_slot: torch.Tensor) -> torch.Tensor:
    """Expert ``s`` multiplies its rows by ``s + 1``: a different, exact map per slot."""
    return (rows.float() * (global_slot + 1)[:, None].float()).to(rows.dtype)


def _reference(hidden, slots, weights) -> torch.Tensor:
    """One process, no movement: the fixed-order fp32 weighted sum over k."""
    acc = torch.zeros(hidden.shape, dtype=torch.float32)
    for k in range(slots.shape[1]):
        contribution = _fake_expert(hidden, slots[:, k]).float() * weights[:, k, None].float()
        acc += torch.where(slots[:, k, None] >= 0, contribution, 0.0)
    return acc.to(hidden.dtype)


def _step(rank, hidden, slots, weights, comm):
    received, local_slot, handle = dispatch(hidden, slots, SLOTS_PER_RANK, comm)
    # run the experts slot by slot, as a grouped GEMM would, then put rows back in place
    order, counts = group_by_slot(local_slot, SLOTS_PER_RANK)
    out = torch.empty_like(received)
    for slot, rows in enumerate(order.split(counts.tolist())):
        out[rows] = _fake_expert(
            received[rows], torch.full_like(rows, rank * SLOTS_PER_RANK + slot)
        )
    return combine(out, weights, handle, comm)


def _ep_worker(rank: int, world_size: int, seed: int) -> dict:
    """Every check of one spawned rank; returns what the parent compares."""
    comm = TorchDistributedComm()
    gathered = torch.empty(world_size * 2, dtype=torch.int64)
    comm.all_gather_into_tensor(gathered, torch.tensor([rank, 10 * rank]))
    summed, largest = torch.tensor([rank + 1.0]), torch.tensor([float(rank)])
    comm.all_reduce(summed)
    comm.all_reduce(largest, op="max")
    comm.barrier()
    outputs, invariant = {}, {}
    for dtype in DTYPES:
        hidden, slots, weights = _make_inputs(seed, world_size, dtype, empty_rank=1)[rank]
        outputs[dtype] = _step(rank, hidden, slots, weights, comm)
        # Batch invariance: rank 0 keeps its tokens but gains new ones around them; every other
        # rank runs different tokens. Rank 0's original tokens must come out bitwise the same.
        other = _make_inputs(seed + 1, world_size, dtype, empty_rank=None)[rank]
        if rank == 0:
            other = tuple(
                torch.cat([o[:2], x, o[2:]]) for o, x in zip(other, (hidden, slots, weights))
            )
        moved = _step(rank, *other, comm)
        invariant[dtype] = moved[2 : 2 + hidden.shape[0]] if rank == 0 else None
    return {
        "gathered": gathered,
        "summed": summed,
        "largest": largest,
        "outputs": outputs,
        "invariant": invariant,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_match_single_process_reference(world_size):
    seed = 1000 + world_size
    results = spawn(_ep_worker, world_size, seed, timeout_s=60)
    for got in results:
        assert got["gathered"].tolist() == [v for r in range(world_size) for v in (r, 10 * r)]
        assert got["summed"].item() == world_size * (world_size + 1) / 2
        assert got["largest"].item() == world_size - 1
    for dtype in DTYPES:
        inputs = _make_inputs(seed, world_size, dtype, empty_rank=1)
        assert inputs[1][0].shape[0] == 0 and results[1]["outputs"][dtype].shape == (0, HIDDEN)
        for rank, (hidden, slots, weights) in enumerate(inputs):
            out = results[rank]["outputs"][dtype]
            assert out.dtype == dtype
            assert torch.equal(out, _reference(hidden, slots, weights)), (rank, dtype)
        assert torch.equal(results[0]["invariant"][dtype], results[0]["outputs"][dtype])


def test_single_process_comm_matches_reference_and_orders_rows():
    hidden, slots, weights = _make_inputs(7, 1, torch.bfloat16, empty_rank=None)[0]
    comm = SingleProcessComm()
    received, local_slot, handle = dispatch(hidden, slots, SLOTS_PER_RANK, comm)
    # world of one: the non-padding pairs arrive in (token, k) order, each a copy of its row
    is_sent = slots.reshape(-1) >= 0
    assert 0 < int(is_sent.sum()) < slots.numel()  # the seed gives both kinds
    tokens = torch.arange(hidden.shape[0]).repeat_interleave(TOP_K)[is_sent]
    assert torch.equal(received, hidden[tokens])
    assert torch.equal(local_slot, slots.reshape(-1)[is_sent])
    assert handle.send_splits == handle.recv_splits == (int(is_sent.sum()),)
    out = combine(_fake_expert(received, local_slot), weights, handle, comm)
    assert torch.equal(out, _reference(hidden, slots, weights))
    order, counts = group_by_slot(local_slot, SLOTS_PER_RANK)
    assert torch.equal(local_slot[order], local_slot.sort(stable=True).values)
    assert all(bool((group.diff() > 0).all()) for group in order.split(counts.tolist()))  # stable
    assert counts.tolist() == [int((slots == s).sum()) for s in range(SLOTS_PER_RANK)]


def test_dispatch_and_combine_reject_bad_shapes():
    comm = SingleProcessComm()
    hidden = torch.randn(4, HIDDEN)
    slots = torch.randint(0, SLOTS_PER_RANK, (4, TOP_K))  # no padding: 12 rows travel
    with pytest.raises(ValueError, match="global_slot: expected dtype int64"):
        dispatch(hidden, slots.int(), SLOTS_PER_RANK, comm)
    with pytest.raises(ValueError, match="global_slot: expected \\[T=4, K\\]"):
        dispatch(hidden, slots[:3], SLOTS_PER_RANK, comm)
    with pytest.raises(ValueError, match="slots_per_rank: expected >= 1"):
        dispatch(hidden, slots, 0, comm)
    received, _, handle = dispatch(hidden, slots, SLOTS_PER_RANK, comm)
    with pytest.raises(ValueError, match="topk_weights: expected \\[4, 3\\]"):
        combine(received, torch.rand(4, TOP_K + 1), handle, comm)
    with pytest.raises(ValueError, match="expert_out: expected \\[R=12, D\\]"):
        combine(received[1:], torch.rand(4, TOP_K), handle, comm)


def test_combine_sums_bf16_rows_into_the_requested_dtype():
    """Rows travel in bf16; with ``out_dtype=float32`` the sum is the one of their fp32 values,
    not rounded back to bf16."""
    comm = SingleProcessComm()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, HIDDEN, generator=gen).bfloat16()
    slots = torch.randint(0, SLOTS_PER_RANK, (9, TOP_K), generator=gen)
    weights = torch.rand(9, TOP_K, generator=gen)
    received, _, handle = dispatch(hidden, slots, SLOTS_PER_RANK, comm)
    out = (received.float() * 3.3).bfloat16()
    wide = combine(out, weights, handle, comm, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, combine(out.float(), weights, handle, comm))
    assert not torch.equal(wide, combine(out, weights, handle, comm).float())
