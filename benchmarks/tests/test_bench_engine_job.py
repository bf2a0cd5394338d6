"""``bench_engine``'s offline job times steady state: each mode runs once untimed first, so the
timed run captures no graph, and each graph mode's graphs are built once and kept across the
async settings. On CPU the graphs run their fixed-shape forward eagerly (``capture=False``):
a new shape still adds a graph, only no replay is counted."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.engine import step_timeline
from benchmarks.engine.bench_engine import _decode_row, _job_rows
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs

EMBEDDED = Path(__file__).resolve().parents[2] / "examples" / "tiny_model" / "checkpoint"
MODES = ["kernels, eager", "kernels, graphs, padded", "kernels, graphs, exact counts"]


@pytest.mark.slow
def test_the_job_times_a_run_after_its_warm_up_with_graphs_built_once() -> None:
    llm = LLM(str(EMBEDDED), dtype="float32", max_model_len=1100, max_num_seqs=1,
              speculative_tokens=0)  # fmt: skip
    runner = llm._core.executor
    loaded = runner.graphs = DecodeGraphs(runner.model, runner.cache, max_batch_size=1,
                                          max_context=1100, capture=False)  # fmt: skip
    built: dict[bool, DecodeGraphs] = {}
    counts = None
    for on in (True, False):
        step_timeline.set_async(llm, on)
        # one request of 16 output tokens (output lengths are drawn from 16..max_tokens)
        rows = _job_rows(llm, 8192, 1, 16, ["graphs", "eager"], built)
        assert [r["ops"] for r in rows] == MODES
        assert [r["tokens"] for r in rows] == [16] * 3
        assert [r["captures"] for r in rows] == [0] * 3, "the timed run added graphs"
        assert rows[0]["graphs"] == 0 and min(r["graphs"] for r in rows[1:]) > 0
        assert runner.graphs is loaded and sorted(built) == [False, True]
        if counts is None:
            counts, objects = [r["graphs"] for r in rows], dict(built)
        else:  # the second setting reuses the first one's graphs: nothing new to capture
            assert [r["graphs"] for r in rows] == counts
            assert all(built[p] is objects[p] for p in built)


@pytest.mark.slow
def test_a_decode_row_is_the_difference_of_the_medians_of_its_calls() -> None:
    llm = LLM(str(EMBEDDED), dtype="float32", max_model_len=256, max_num_seqs=2,
              speculative_tokens=0)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    row = _decode_row(llm, llm._core.executor.model, gen, 8192, 2, 5, 1.0, "eager", repeats=3)
    assert len(row["full_s"]) == len(row["base_s"]) == 3
    seconds = statistics.median(row["full_s"]) - statistics.median(row["base_s"])
    assert row["seconds"] == pytest.approx(seconds)
    assert row["step_ms"] == pytest.approx(seconds / 4 * 1e3)
    assert row["tokens"] == 2 * 4 and row["tok/s"] == pytest.approx(2 / (seconds / 4))
