"""ExpertParallelContext: its layout checks and starting placement; move_slots in one process
(local moves only: no collective runs) and its row check."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel import (
    ExpertParallelContext,
    ExpertPlacement,
    ParallelConfig,
    SingleProcessComm,
    move_slots,
)


class _Group:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_to_all_single(self, *args, **kwargs):
        raise AssertionError("a collective ran")


class _TwoRanks(SingleProcessComm):
    """Rank 0 of two, for checks that fail before any collective."""

    world_size = 2


def test_context_from_config_and_placement():
    config = ParallelConfig(2, 2, num_redundant_experts=1, eplb_interval=10, eplb_window=7)
    ctx = ExpertParallelContext.from_config(config, _Group(1, 2))
    assert (ctx.rank, ctx.world_size, ctx.eplb_window, ctx.num_redundant_experts) == (1, 2, 7, 1)
    assert ctx.placement(8).local_experts(1) == (4, 5, 6, 7, 0)
    off = ExpertParallelContext.from_config(ParallelConfig(2, 2), _Group(0, 2))
    assert off.eplb_window == 0  # no EPLB, no load window
    with pytest.raises(ValueError, match="expected a group of expert_parallel_size=2"):
        ExpertParallelContext.from_config(config, _Group(0, 4))
    with pytest.raises(ValueError, match="expert_parallel_size=2: expected a divisor"):
        ctx.placement(7)
    with pytest.raises(ValueError, match="num_redundant_experts: expected >= 0"):
        ExpertParallelContext(_Group(0, 2), num_redundant_experts=-1)


def test_move_slots_within_a_rank_copies_and_runs_no_collective():
    old = ExpertPlacement(4, 1, 5, ((0, 1, 2, 3, 0),))
    new = ExpertPlacement(4, 1, 5, ((0, 1, 2, 3, 3),))  # slot 4: expert 0 -> 3
    rows = torch.randint(0, 255, (5, 6), dtype=torch.uint8)
    moved = move_slots(old, new, lambda slot: rows[slot], 6, _Group(0, 1))
    assert list(moved) == [4] and torch.equal(moved[4], rows[3])
    rows[3] = 0  # a copy, safe to write after every read
    assert moved[4].any()


def test_move_slots_checks_the_rows_it_sends():
    old = ExpertPlacement(2, 2, 1, ((0,), (1,)))
    new = ExpertPlacement(2, 2, 1, ((1,), (0,)))
    rows = torch.zeros(1, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"read_slot: expected a \[16\] uint8 row"):
        move_slots(old, new, lambda slot: rows[slot], 16, _TwoRanks())
