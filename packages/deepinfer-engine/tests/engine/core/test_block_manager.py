import random

import pytest

from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.state_slots import StateSlotPool


def test_allocate_and_free_track_ref_counts():
    bm = BlockManager(num_blocks=9, block_size=4)
    assert bm.num_usable_blocks == 8
    a = bm.allocate(3)
    assert 0 not in a and len(set(a)) == 3
    assert bm.num_free_blocks == 5
    shared = bm.share(a[:2])
    assert [bm.ref_count(b) for b in a] == [2, 2, 1]
    bm.free(a)
    assert bm.num_free_blocks == 6  # only the unshared block came back
    bm.free(shared)
    assert bm.num_free_blocks == 8
    assert bm.num_blocks_for_tokens(9) == 3 and bm.num_blocks_for_tokens(8) == 2


def test_copy_on_write_only_for_shared_blocks():
    bm = BlockManager(num_blocks=5, block_size=4)
    (b,) = bm.allocate(1)
    assert bm.copy_on_write(b) is None
    bm.share([b])
    new = bm.copy_on_write(b)
    assert new is not None and new != b
    assert bm.ref_count(b) == 1 and bm.ref_count(new) == 1


def test_errors_name_the_problem():
    bm = BlockManager(num_blocks=3, block_size=4)
    with pytest.raises(RuntimeError, match="only 2 free"):
        bm.allocate(3)
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        bm.free([1])
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockManager(num_blocks=1, block_size=4)


def test_random_operations_conserve_blocks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=33, block_size=8)
    held: list[int] = []  # one entry per reference
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and bm.can_allocate(k := rng.randint(1, 4)):
            held += bm.allocate(k)
        elif op < 0.6 and held:
            held += bm.share([rng.choice(held)])
        elif held:
            b = held.pop(rng.randrange(len(held)))
            bm.free([b])
        distinct = set(held)
        assert bm.num_free_blocks == 32 - len(distinct)
        for b in distinct:
            assert bm.ref_count(b) == held.count(b)


def test_state_slots_hand_out_lowest_free_id_and_reserve_zero():
    pool = StateSlotPool(4)
    slots = [pool.allocate() for _ in range(3)]
    assert slots == [1, 2, 3] and not pool.can_allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(2)
    pool.free(1)
    assert pool.allocate() == 1
    with pytest.raises(ValueError, match="state slot 2 is not allocated"):
        pool.free(2)
