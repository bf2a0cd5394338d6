"""Asynchronous scheduling on the GPU (skipped without CUDA), on the shipped tiny model in
batch-invariant mode: outputs equal the synchronous loop's (greedy, seeded, n = 2, with and
without speculation), and with ``DEEPINFER_SYNC_GUARD=1`` decode steps that replay a captured
graph run without any host synchronisation but the read-back of their tokens.

    python -m pytest packages/deepinfer-engine/tests/engine/runner/test_async_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
CHECKPOINT = Path(__file__).resolve().parents[5] / "examples" / "tiny_model" / "checkpoint"
PROMPTS = [
    "def parse(self, ",
    "import os\n\n\ndef ",
    "class Error(Exception):\n    ",
    "    return ",
]


def _engine(**kwargs) -> LLM:
    return LLM(str(CHECKPOINT), accelerator="nvidia", max_model_len=256,
               gpu_memory_utilization=0.3, **kwargs)  # fmt: skip


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=32, stop=["\n"]),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
    ]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("speculative_tokens", [0, 5])
def test_async_outputs_equal_sync_on_the_gpu(monkeypatch, speculative_tokens):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    runs = {}
    for async_scheduling in (False, True):
        llm = _engine(speculative_tokens=speculative_tokens, async_scheduling=async_scheduling)
        runs[async_scheduling] = _tokens(llm.generate(PROMPTS * 4, _params() * 4, use_tqdm=False))
        del llm
    assert runs[True] == runs[False]


def test_graph_decode_steps_never_sync_the_host(monkeypatch):
    llm = _engine(speculative_tokens=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))  # captures the graphs
    graphs = llm._core.executor.graphs
    assert graphs is not None, "the tiny model should run decode graphs on a GPU"
    replays = graphs.num_replays
    monkeypatch.setenv("DEEPINFER_SYNC_GUARD", "1")
    got = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))  # raises on a sync
    assert got == want and graphs.num_replays >= replays + 20
    with pytest.raises(RuntimeError, match="synchroniz"):  # the guard does fire
        from deepinfer.engine.runner.async_step import sync_guard

        with sync_guard(torch.device("cuda")):
            torch.ones(1, device="cuda").item()
