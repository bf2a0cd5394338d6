"""The decode graphs' fixed-shape metadata is the eager step's metadata, padded: the same
window base, window lists (the token's own position read from its step row), ring writes,
visible lists (``-1`` past the eager width) and entry plans for the real rows; padding rows
read like the first token and write to the scratch slot and the null block only."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from deepinfer.engine.model.cache import CacheLayout
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.metadata import ForwardBatch, build_metadata
from deepinfer.engine.runner.decode_metadata import SCRATCH_SLOT, DecodeLayout
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config


def _check(raw, block_size: int, positions: list[int]) -> None:
    config = parse_config(raw)
    layout = CacheLayout(num_blocks=16, num_slots=6, block_size=block_size)
    ring, context = config.sliding_window, 4 * block_size
    t, rows = len(positions), 8
    slots = [4, 1, 5][:t]
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(t)]
    ids = [7, 8, 9][:t]
    p = torch.tensor(positions)
    eager = build_metadata(
        ForwardBatch(torch.tensor(ids), p, torch.arange(t + 1), p + 1, torch.tensor(tables),
                     torch.tensor(slots)), config, layout, ring,
    )  # fmt: skip
    fixed_layout = DecodeLayout(config, layout, ring, num_tokens=rows, context=context)
    flat = np.zeros(fixed_layout.size, dtype=np.int64)
    fixed_layout.fill(flat, ids, positions, tables, slots)
    _, fixed = fixed_layout.metadata(torch.from_numpy(flat))

    assert fixed.window_base == eager.window_base == layout.num_slots * ring
    assert torch.equal(fixed.window_indices[:t], eager.window_indices)
    # padding rows: row 0's window, their own step row for their own position
    pad = fixed.window_indices[t:]
    assert torch.equal(pad[:, :-1], eager.window_indices[:1, :-1].expand(rows - t, -1))
    assert pad[:, -1].tolist() == [eager.window_base + r for r in range(t, rows)]
    assert torch.equal(fixed.window_write_src[eager.window_write_src], eager.window_write_src)
    assert torch.equal(fixed.window_write_dst[:t], eager.window_write_dst)
    assert (fixed.window_write_dst[t:] // ring == SCRATCH_SLOT).all()
    assert fixed.plans.keys() == eager.plans.keys() and eager.plans
    for kind, want in eager.plans.items():
        got = fixed.plans[kind]
        width = want.all_visible().shape[1]
        assert torch.equal(got.visible[:t, :width], want.all_visible())
        assert (got.visible[:t, width:] == -1).all()
        assert torch.equal(got.visible_count[:t], want.visible_count)
        n = want.emit_rows.shape[0]
        assert torch.equal(got.emit_rows[:n], want.emit_rows)
        assert torch.equal(got.emit_positions[:n], want.emit_positions)
        assert (got.emit_rows[n:] == 0).all()  # padding entries go to the null block


def test_v4_fixed_metadata_is_the_eager_one_padded():
    _check(tiny_v4_config(hca_ratio=8), 16, [3, 39, 47])  # entries of ratio 4 and 8 complete


def test_v41_fixed_metadata_is_the_eager_one_padded():
    _check(tiny_v41_config(vision=False), 16, [1, 20, 33])


def _check_verification(raw, block_size: int, starts: list[int], counts: list[int]) -> None:
    """A verification step (``counts[b]`` = 1 + drafts of sequence b, ragged) laid out per
    token: every real row's lists and writes are the eager step's."""
    config = parse_config(raw)
    layout = CacheLayout(num_blocks=24, num_slots=6, block_size=block_size, max_draft=4)
    ring, context = config.sliding_window + 4, 4 * block_size
    slots = [4, 1, 5][: len(starts)]
    tables = [[1 + 5 * i + j for j in range(5)] for i in range(len(starts))]
    positions = [q for a, n in zip(starts, counts) for q in range(a, a + n)]
    t, rows = len(positions), 16
    ids = [20 + i for i in range(t)]
    cu = np.concatenate([[0], np.cumsum(counts)]).tolist()
    ends = [a + n for a, n in zip(starts, counts)]
    eager = build_metadata(
        ForwardBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(cu),
                     torch.tensor(ends), torch.tensor(tables), torch.tensor(slots)),
        config, layout, ring,
    )  # fmt: skip
    fixed_layout = DecodeLayout(config, layout, ring, num_tokens=rows, context=context)
    flat = np.zeros(fixed_layout.size, dtype=np.int64)
    fixed_layout.fill(flat, ids, positions, tables, slots, cu)
    batch, fixed = fixed_layout.metadata(torch.from_numpy(flat))
    assert torch.equal(batch.state_slots[:t], torch.tensor(slots).repeat_interleave(
        torch.tensor(counts)))  # fmt: skip
    assert torch.equal(fixed.window_indices[:t], eager.window_indices)
    assert torch.equal(eager.window_write_src, torch.arange(t))
    assert torch.equal(fixed.window_write_dst[:t], eager.window_write_dst)
    assert (fixed.window_write_dst[t:] // ring == SCRATCH_SLOT).all()
    emitted = 0
    for kind, want in eager.plans.items():
        got = fixed.plans[kind]
        width = want.all_visible().shape[1]
        assert torch.equal(got.visible[:t, :width], want.all_visible())
        assert torch.equal(got.visible_count[:t], want.visible_count)
        assert torch.equal(want.state_write_src, torch.arange(t))
        assert torch.equal(got.state_write_dst[:t], want.state_write_dst)
        assert (got.state_write_dst[t:] // want.state_rows == SCRATCH_SLOT).all()
        n = want.emit_rows.shape[0]
        emitted += n
        assert torch.equal(got.emit_src[:n], want.emit_src)
        assert torch.equal(got.emit_rows[:n], want.emit_rows)
        assert torch.equal(got.emit_positions[:n], want.emit_positions)
    assert emitted >= 3, "too few entries completed to check their sources"


def test_verification_fixed_metadata_is_the_eager_one_padded():
    # entries complete at the first token, inside the drafts and at the last draft
    _check_verification(tiny_v4_config(hca_ratio=8), 16, [3, 37, 10], [4, 5, 1])
    _check_verification(tiny_v41_config(vision=False), 16, [1, 20, 33], [3, 5, 2])


def test_a_refilled_buffer_equals_a_fresh_one():
    """The graphs share one host buffer: a short step after a long one leaves nothing of it
    (the visible lists are looked up only up to the step's longest count, the rest set to -1),
    also as a refill (which writes -1 only where the previous fill looked entries up)."""
    config = parse_config(tiny_v41_config(vision=False))
    layout = CacheLayout(num_blocks=24, num_slots=6, block_size=16)
    fixed = DecodeLayout(config, layout, config.sliding_window, num_tokens=4, context=64)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    long_step = ([7, 8, 9], [60, 61, 40], tables, [1, 2], [0, 2, 3])
    short_step = ([3, 4], [2, 5], tables, [2, 1], [0, 1, 2])
    used = np.full(fixed.size, 12345, dtype=np.int64)
    fixed.fill(used, *long_step)
    visible = [name for name in fixed.fields if name.endswith("visible")]
    assert all((fixed.views(used)[name][:, 6:] >= 0).any() for name in visible)
    fixed.fill(used, *short_step)  # positions up to 5: at most 6 entries of any ratio
    assert all((fixed.views(used)[name][:, 6:] == -1).all() for name in visible)
    fresh = np.zeros(fixed.size, dtype=np.int64)
    fixed.fill(fresh, *short_step)
    assert np.array_equal(used, fresh)
    # a refill rewrites only the columns its previous fill of the buffer set
    fixed.fill(used, *long_step)
    fixed.fill(used, *short_step, refill=True)
    assert np.array_equal(used, fresh)


def test_refills_of_decode_steps_equal_fresh_fills():
    """A refill rewrites only the visible columns past those every row kept through the same
    blocks: decode steps that add entries, a new block, a replaced block and a shorter step
    in between all leave the buffer as a fresh fill writes it."""
    config = parse_config(tiny_v41_config(vision=False))
    layout = CacheLayout(num_blocks=24, num_slots=6, block_size=16)
    new = partial(DecodeLayout, config, layout, config.sliding_window, 4, 64, (2, 2))
    fixed, used = new(), np.full(new().size, 12345, dtype=np.int64)
    tables = [[1, 2, 0], [5, 6, 7]]
    steps = [([30, 41], tables), ([31, 42], tables), ([32, 43], [[1, 2, 3], [5, 6, 7]]),
             ([33, 44], [[1, 9, 3], [5, 6, 7]]), ([4, 45], [[1, 9, 3], [5, 6, 7]]),
             ([34, 47], [[1, 9, 3], [5, 6, 7]])]  # fmt: skip
    for i, (positions, step_tables) in enumerate(steps):
        args = ([7, 8], positions, step_tables, [1, 2])
        fixed.fill(used, *args, refill=i > 0)
        fresh = np.zeros(fixed.size, dtype=np.int64)
        new().fill(fresh, *args)
        assert np.array_equal(used, fresh), i
