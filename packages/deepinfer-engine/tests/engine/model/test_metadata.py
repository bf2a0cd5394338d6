"""Index lists of one step, checked by hand on small cases: window rows in [ring | step]
space, compressed-entry visibility (w < (t + 1) // ratio), arena addressing through block
tables padded with -1, and the emission plan of the overlapped ratio-4 compressor."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.metadata import ForwardBatch, build_metadata

from .test_v4_invariants import RAW  # noqa: TID252  (window 8, ratios 4 and 128)

CONFIG = parse_config(RAW)
LAYOUT = CacheLayout(num_blocks=6, num_slots=3, block_size=128)
RING = CONFIG.sliding_window  # max_draft 0


def _batch(runs, tables, slots):
    """runs: [(start, n)] per sequence."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in runs])
    cu = torch.tensor([0] + [n for _, n in runs]).cumsum(0)
    lens = torch.tensor([s + n for s, n in runs])
    return ForwardBatch(
        positions.clone(), positions, cu, lens, torch.tensor(tables).int(), torch.tensor(slots)
    )


def test_window_rows_mix_ring_and_step_tokens():
    # seq A (slot 2) decodes position 10; seq B (slot 0) prefills positions 0..2
    md = build_metadata(_batch([(10, 1), (0, 3)], [[4, 5], [1, -1]], [2, 0]), CONFIG, LAYOUT, RING)
    base = LAYOUT.num_slots * RING
    want_a = [2 * RING + q % RING for q in range(3, 10)] + [base + 0]
    assert md.window_indices[0].tolist() == want_a
    assert md.window_indices[3].tolist() == [-1] * 5 + [base + 1, base + 2, base + 3]
    assert md.window_write_dst.tolist() == [2 * RING + 10 % RING, 0, 1, 2]


def test_visibility_and_arena_rows_through_padded_tables():
    md = build_metadata(
        _batch([(0, 13), (200, 2)], [[4, -1], [1, 2]], [0, 1]), CONFIG, LAYOUT, RING
    )
    plan = md.plans[(4, True)]
    per_block = 128 // 4
    counts = plan.visible_count.tolist()
    assert counts[:13] == [(t + 1) // 4 for t in range(13)]
    assert plan.all_visible()[12].tolist()[:3] == [4 * per_block + w for w in range(3)]
    assert plan.all_visible()[12].tolist()[3:] == [-1] * (plan.all_visible().shape[1] - 3)
    # position 201 sees entries 0..49; entry 49 (positions 196..199) sits in block 1 -> id 2
    assert plan.visible_count[14].item() == 50
    assert plan.all_visible()[14, 49].item() == 2 * per_block + 49 % per_block
    # entries completed this step: 0..2 of seq A; seq B's entry 50 needs position 203
    assert plan.emit_positions.tolist() == [0, 4, 8]
    # entry 1 pools positions 0..3 (previous window, first halves) and 4..7
    base = LAYOUT.num_slots * plan.state_rows
    assert plan.emit_src[1].tolist() == [base + p for p in range(8)]
    assert plan.emit_src[0].tolist()[:4] == [-1] * 4
    hca = md.plans[(128, False)]
    assert hca.visible_count[-1].item() == 201 // 128


def test_positions_must_be_the_consecutive_run():
    batch = _batch([(0, 3)], [[0, -1]], [0])
    bad = ForwardBatch(batch.input_ids, torch.tensor([0, 2, 3]), *list(batch.__dict__.values())[2:])
    with pytest.raises(ValueError, match="consecutive"):
        build_metadata(bad, CONFIG, LAYOUT, RING)


@pytest.mark.parametrize("query_rows", [None, [0, 5, 13, 14, 20, 21, 30]])
def test_visible_lists_are_each_tokens_prefix_of_its_sequence(query_rows):
    """The per-sequence rows, the query -> sequence map and the counts give each query's
    visible list: entry w of its sequence, for w < (p + 1) // ratio, through its block table."""
    runs, tables = [(0, 13), (200, 2), (250, 16)], [[4, -1, -1], [1, 2, -1], [0, 3, 5]]
    batch = _batch(runs, tables, [0, 1, 2])
    rows = None if query_rows is None else torch.tensor(query_rows)
    md = build_metadata(batch, CONFIG, LAYOUT, RING, query_rows=rows)
    owner = [b for b, (_, n) in enumerate(runs) for _ in range(n)]
    queries = range(len(owner)) if query_rows is None else query_rows
    for (ratio, _), plan in md.plans.items():
        per_block = 128 // ratio
        want = []
        for t in queries:
            b, p = owner[t], batch.positions[t].item()
            seen = [tables[b][w // per_block] * per_block + w % per_block
                    for w in range((p + 1) // ratio)]  # fmt: skip
            want.append(seen)
        width = max(len(w) for w in want)
        assert plan.all_visible().tolist() == [w + [-1] * (width - len(w)) for w in want]
        assert plan.visible_count.tolist() == [len(w) for w in want]
        assert plan.q_seq.tolist() == [owner[t] for t in queries]
        assert plan.seq_rows.shape == (len(runs), width)
        # [T, C] lists only for the kind attended whole (ratio 128); the indexer's are not formed
        assert (plan.visible is not None) == (ratio == 128)
