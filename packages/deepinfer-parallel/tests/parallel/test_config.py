from __future__ import annotations

import pytest

from deepinfer.parallel import ParallelConfig, expert_owner, expert_range


@pytest.mark.parametrize("num_experts,ep_size", [(256, 1), (256, 8), (10, 3), (7, 7), (384, 5)])
def test_expert_ranges_partition_and_balance(num_experts, ep_size):
    ranges = [expert_range(num_experts, ep_size, r) for r in range(ep_size)]
    flat = [e for rg in ranges for e in rg]
    assert flat == list(range(num_experts))
    sizes = [len(rg) for rg in ranges]
    assert max(sizes) - min(sizes) <= 1
    for rank, rg in enumerate(ranges):
        assert all(expert_owner(e, num_experts, ep_size) == rank for e in rg)


def test_invalid_layouts_name_the_field():
    with pytest.raises(ValueError, match="dp_size"):
        ParallelConfig(world_size=4, dp_size=3)
    with pytest.raises(ValueError, match="ep_rank"):
        expert_range(8, 2, 2)
    with pytest.raises(ValueError, match="expert"):
        expert_owner(8, 8, 2)
    assert ParallelConfig(world_size=8, dp_size=4).ep_size == 8
