import random

import pytest

from deepinfer.engine.runner.capacity import plan_cache_capacity


def test_capacity_fills_the_budget_and_no_more():
    rng = random.Random(0)
    for _ in range(200):
        total = rng.randint(10, 140) << 30
        util = rng.uniform(0.5, 0.95)
        peak = rng.randint(1 << 28, int(total * util * 0.5))
        per_block = rng.randint(10_000, 200_000)
        per_slot = rng.randint(0, 4 << 20)
        seqs = rng.randint(1, 512)
        cap = plan_cache_capacity(
            total_memory_bytes=total,
            peak_memory_bytes=peak,
            gpu_memory_utilization=util,
            bytes_per_block=per_block,
            bytes_per_state_slot=per_slot,
            max_num_seqs=seqs,
            block_size=128,
        )
        used = peak + cap.num_blocks * per_block + cap.num_state_slots * per_slot
        assert used <= total * util < used + per_block
        assert cap.num_sequences == seqs and cap.num_tokens == (cap.num_blocks - 1) * 128


def test_no_room_names_the_numbers():
    with pytest.raises(ValueError, match="no room for the KV cache: 50% of 1.00 GiB"):
        plan_cache_capacity(
            total_memory_bytes=1 << 30,
            peak_memory_bytes=1 << 29,
            gpu_memory_utilization=0.5,
            bytes_per_block=1 << 20,
            bytes_per_state_slot=0,
            max_num_seqs=4,
            block_size=128,
        )
