"""Prefill-sized steps read the cache rows they need as float copies (one source format for the
attention and indexer kernels) instead of the packed cache in place: the copied lists name the
same rows, and the logits are bitwise those of the in-place reads."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model import metadata as metadata_module
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import build_metadata

from .test_cache_formats import _run, packed_model_and_steps  # noqa: TID252
from .test_metadata import CONFIG, LAYOUT, RING, _batch  # noqa: TID252


def test_copied_lists_name_the_same_rows(monkeypatch):
    monkeypatch.setattr(metadata_module, "COPY_READS_MIN_ROWS", 4)
    # seq A (slot 2) continues at position 40 with 9 rows; seq B (slot 0) starts with 12
    batch = _batch([(40, 9), (0, 12)], [[4, 5], [1, -1]], [2, 0])
    md = build_metadata(batch, CONFIG, LAYOUT, RING, copy_reads=True)
    reads = md.cache_reads()
    assert reads is not None
    _check_copied_window_lists(md, reads)
    for plan in md.plans.values():
        read = plan.read_rows.tolist()
        assert read == sorted(set(read))
        assert {v for v in plan.all_visible().flatten().tolist() if v >= 0} <= set(read)
        mapped = metadata_module.read_index(plan.read_rows, plan.all_visible()).flatten().tolist()
        for got, want in zip(mapped, plan.all_visible().flatten().tolist()):
            assert (got == -1) if want < 0 else read[got] == want
    # a replaced window list (as YoCo's narrowing does) leaves no stale copy lists
    narrowed = metadata_module.dataclasses.replace(md, window_indices=md.window_indices.clone())
    assert narrowed.cache_reads() is None


@pytest.mark.parametrize("seed", range(6))
def test_ring_rows_are_the_rows_the_window_lists_name(seed, monkeypatch):
    """The copied ring rows, found per sequence from its lowest query's window, are exactly
    the ring rows its window lists name, for random runs and query-row subsets (context
    parallelism), and the copied lists translate the window lists entry by entry."""
    monkeypatch.setattr(metadata_module, "COPY_READS_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (3,), generator=gen).tolist()
    counts = torch.randint(12, 30, (3,), generator=gen).tolist()
    batch = _batch(list(zip(starts, counts)), [[1, 2], [3, 4], [5, -1]], [2, 0, 1])
    total = sum(counts)
    queries = None
    if seed % 2:
        queries = torch.randperm(total, generator=gen)[: 2 * total // 3].sort().values
    md = build_metadata(batch, CONFIG, LAYOUT, RING, query_rows=queries, copy_reads=True)
    reads = md.cache_reads()
    assert reads is not None
    _check_copied_window_lists(md, reads)


def _check_copied_window_lists(md, reads) -> None:
    """The copied ring rows are every ring row the window lists name, once each, sorted, and
    the copied lists translate the window lists entry by entry."""
    base = LAYOUT.num_slots * RING
    window = md.window_indices.flatten().tolist()
    rings = reads.ring_rows.tolist()
    assert rings == sorted({w for w in window if 0 <= w < base})
    for got, want in zip(reads.window_indices.flatten().tolist(), window, strict=True):
        if want < 0:
            assert got == -1
        elif want < base:
            assert rings[got] == want
        else:
            assert got == len(rings) + want - base


def test_small_steps_and_wide_reads_read_in_place():
    batch = _batch([(40, 9), (0, 12)], [[4, 5], [1, -1]], [2, 0])
    assert build_metadata(batch, CONFIG, LAYOUT, RING, copy_reads=True).reads is None
    assert build_metadata(batch, CONFIG, LAYOUT, RING).reads is None


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_copied_reads_run_bitwise_like_in_place_reads(family, monkeypatch):
    model, steps = packed_model_and_steps(family, seed=5, decodes=3)
    copies = []
    gather = ModelCache.gather

    def counting_gather(self, key, rows):
        copies.append(key)
        return gather(self, key, rows)

    monkeypatch.setattr(ModelCache, "gather", counting_gather)
    with torch.no_grad():
        monkeypatch.setattr(metadata_module, "COPY_READS_MIN_ROWS", 10**9)
        want, _ = _run(model, steps, packed=True)
        assert not copies
        monkeypatch.setattr(metadata_module, "COPY_READS_MIN_ROWS", 8)
        got, _ = _run(model, steps, packed=True)
    kinds = {key.rsplit(".", 1)[1] for key in copies}
    assert kinds == {"window", "kv", "index_keys"}, kinds
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
