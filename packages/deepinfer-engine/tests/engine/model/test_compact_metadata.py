"""Compact metadata (the engine's steps: attention reads only the rings of slots up to the
batch's highest and the arena rows the step can see) gives bit-identical logits to the full
layout, for V4 (overlapped ratio 4, ratio 128, CSA indexer) and V4.1 (shared sources, index
sources, candidate filter), over batched chunked prefill and decode with ragged slots."""

from __future__ import annotations

import pytest
import torch

import deepinfer.engine.model.stack as stack_module
from deepinfer.engine.model.metadata import build_metadata
from deepinfer.engine.testing.simple_runner import SimpleRunner

from .test_v4_invariants import RAW as V4_RAW  # noqa: TID252
from .test_v4_invariants import random_model as random_v4_model  # noqa: TID252
from .test_v41_invariants import VOCAB as V41_VOCAB  # noqa: TID252
from .test_v41_invariants import random_v41_model  # noqa: TID252

MAX_LEN = 150
V4_VOCAB = V4_RAW["vocab_size"]


def _schedule(vocab: int) -> list[dict[int, list[int]]]:
    """Steps of {sequence: new tokens}: sequence 3 alone first (the highest slot), then
    prefill chunks and decode of 0 and 1 around it, then 0 alone (slots above it unused)."""
    gen = torch.Generator().manual_seed(7)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    steps = [{3: tokens(40)}, {0: tokens(70), 1: tokens(9)}, {0: tokens(65), 3: tokens(1)}]
    steps += [{0: tokens(1), 1: tokens(1)} for _ in range(3)]
    steps += [{0: tokens(1)} for _ in range(3)]
    return steps


def _run(model, steps, compact: bool, monkeypatch, block_size: int) -> list[torch.Tensor]:
    def metadata(*args, **kwargs):
        return build_metadata(*args, **{**kwargs, "compact": compact})

    monkeypatch.setattr(stack_module, "build_metadata", metadata)
    runner = SimpleRunner(model, max_seqs=4, max_len=MAX_LEN, block_size=block_size)
    out = []
    for chunks in steps:
        logits = runner.step(chunks)
        out += [logits[seq] for seq in sorted(logits)]
    return out


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_compact_metadata_gives_identical_logits(family, monkeypatch):
    model, vocab = (
        (random_v4_model(), V4_VOCAB) if family == "v4" else (random_v41_model(), V41_VOCAB)
    )
    steps, block_size = _schedule(vocab), 128 if family == "v4" else 16  # V4: ratio 128
    full = _run(model, steps, False, monkeypatch, block_size)
    compact = _run(model, steps, True, monkeypatch, block_size)
    assert len(full) == len(compact) == sum(len(s) for s in steps)
    for a, b in zip(full, compact, strict=True):
        assert torch.equal(a, b)


def test_compact_plans_read_what_queries_see():
    """The compact window base is the rings up to the highest slot, and every arena row a
    query can see is in its kind's read rows (and only rows of the batch's tables)."""
    model = random_v41_model()
    runner = SimpleRunner(model, max_seqs=4, max_len=MAX_LEN, block_size=16)
    runner.lengths = {1: 30}
    batch = runner.batch({0: list(range(5)), 1: [3]})
    full = build_metadata(batch, model.config, runner.cache.layout, runner.cache.ring_size)
    compact = build_metadata(
        batch, model.config, runner.cache.layout, runner.cache.ring_size, compact=True
    )
    ring = runner.cache.ring_size
    assert full.window_base == 4 * ring and compact.window_base == 2 * ring
    for kind, plan in compact.plans.items():
        assert full.plans[kind].read_rows is None
        visible = plan.visible[plan.visible >= 0].unique()
        assert torch.equal(plan.read_rows, plan.read_rows.sort().values)
        assert torch.isin(visible, plan.read_rows).all() and len(plan.read_rows) > 0
        per_block = runner.cache.layout.block_size // kind[0]
        blocks = (plan.read_rows // per_block).unique()
        assert torch.isin(blocks, batch.block_tables.long().flatten()).all()
