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


def test_defaults_are_one_process_without_eplb():
    config = ParallelConfig()
    assert (config.world_size, config.dp_size, config.ep_size) == (1, 1, 1)
    assert not config.is_eplb_enabled
    assert config.eplb_window == 100
    config.validate_for(num_experts=256, num_devices=1)


def test_layout_derives_world_size_and_slots():
    config = ParallelConfig(
        data_parallel_size=4, expert_parallel_size=4, num_redundant_experts=1, eplb_interval=50
    )
    assert config.world_size == 4
    assert config.is_eplb_enabled
    assert config.slots_per_rank(256) == 65
    config.validate_for(num_experts=256, num_devices=8)


def test_data_parallel_with_replicated_experts():
    config = ParallelConfig(data_parallel_size=4, expert_parallel_size=1)
    assert (config.world_size, config.dp_size, config.ep_size) == (4, 4, 1)
    assert config.slots_per_rank(10) == 10
    config.validate_for(num_experts=10, num_devices=4)
    with pytest.raises(ValueError, match="needs 4 devices, found 3"):
        config.validate_for(num_experts=10, num_devices=3)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"data_parallel_size": 0, "expert_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 2, "expert_parallel_size": 4}, "attention DP spans the EP ranks"),
        ({"data_parallel_size": 4, "expert_parallel_size": 2}, "expert_parallel_size=2"),
        ({"num_redundant_experts": -1}, "num_redundant_experts"),
        ({"eplb_interval": -5}, "eplb_interval"),
        ({"eplb_window": 0}, "eplb_window"),
        ({"eplb_window": 2.5}, "eplb_window"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_validate_for_model_and_devices():
    config = ParallelConfig(data_parallel_size=3, expert_parallel_size=3)
    with pytest.raises(ValueError, match="expected a divisor of the model's 256 routed experts"):
        config.validate_for(num_experts=256, num_devices=3)
    with pytest.raises(ValueError, match="needs 3 devices, found 2"):
        config.validate_for(num_experts=384, num_devices=2)
    config.validate_for(num_experts=384, num_devices=3)


def test_expert_range_errors_name_the_field():
    with pytest.raises(ValueError, match="ep_rank"):
        expert_range(8, 2, 2)
    with pytest.raises(ValueError, match="expert"):
        expert_owner(8, 8, 2)
