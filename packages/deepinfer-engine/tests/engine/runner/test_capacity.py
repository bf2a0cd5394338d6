import random

import pytest

from deepinfer.engine.runner.capacity import HEADROOM_BYTES, device_peak_bytes, plan_cache_capacity


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
    with pytest.raises(ValueError, match="no room for the KV cache: 50% of 1.00 GiB") as info:
        plan_cache_capacity(
            total_memory_bytes=1 << 30,
            peak_memory_bytes=1 << 29,
            gpu_memory_utilization=0.5,
            bytes_per_block=1 << 20,
            bytes_per_state_slot=0,
            max_num_seqs=4,
            block_size=128,
        )
    assert "free the device memory other processes hold" in str(info.value)


GIB = 1 << 30


def _budget(total, free, free_before, activation, reserve, util, held=0):
    peak = device_peak_bytes(
        total_bytes=total,
        free_bytes=free,
        free_before_load_bytes=free_before,
        held_before_load_bytes=held,
        activation_bytes=activation,
        reserve_bytes=reserve,
        gpu_memory_utilization=util,
    )
    return int(total * util) - peak


def test_other_processes_memory_does_not_count_against_the_share():
    total, weights, activation, reserve = 140 * GIB, 3 * GIB, 2 * GIB, GIB
    for others in (0, 20 * GIB, 60 * GIB):  # another worker's engine on the same GPU
        free_before = total - GIB // 2 - others  # this process's CUDA context and the others
        free = free_before - weights
        budget = _budget(total, free, free_before, activation, reserve, 0.3)
        assert budget == int(total * 0.3) - weights - activation - reserve, others


def test_memory_this_process_held_before_loading_counts_against_the_share():
    # a benchmark's buffers in torch's cache before the engine loads: the engine's weights
    # reuse 2 GiB of those cached blocks (free memory falls by 1 GiB only)
    total, held, activation, reserve = 80 * GIB, 3 * GIB, GIB, GIB
    free_before = total - GIB // 2 - held
    free = free_before - GIB
    budget = _budget(total, free, free_before, activation, reserve, 0.85, held)
    assert budget == int(total * 0.85) - held - GIB - activation - reserve
    # what the device then holds, cache included, stays within the share
    assert (total - free) + activation + reserve + budget <= int(total * 0.85) + GIB // 2


def test_the_budget_never_exceeds_the_free_memory():
    rng = random.Random(1)
    for _ in range(500):
        total = rng.randint(8, 141) * GIB
        free_before = rng.randint(total // 20, total)
        held = rng.randint(0, total - free_before)
        free = free_before - rng.randint(0, free_before // 2)
        activation, reserve = rng.randint(0, GIB), rng.randint(0, GIB)
        util = rng.uniform(0.05, 0.95)
        budget = _budget(total, free, free_before, activation, reserve, util, held)
        room = free - activation - reserve - HEADROOM_BYTES
        own = held + free_before - free + activation + reserve
        assert budget <= room and budget <= int(total * util) - own
        assert budget in (room, int(total * util) - own)  # one of the two bounds
