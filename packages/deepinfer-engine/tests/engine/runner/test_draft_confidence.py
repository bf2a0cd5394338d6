"""Draft confidences use the checkpoint's ``dspark_confidence_temperature``:
``sigmoid(logit / T)``, so with T = 2 every confidence's logit is half the one with T = 1 (same
drafts, batch-invariant mode), whether the stages run eagerly or on the draft graph's
fixed-shape forward (greedy picks inside it); a temperature <= 0 is refused naming the field."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.draft_graphs import DraftGraphs
from deepinfer.sampling import SamplingParams


def _with_temperature(source, target, temperature):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    text["dspark_confidence_temperature"] = temperature
    (target / "config.json").write_text(json.dumps(config))
    return target


def _confidences(directory, graphs: bool = False) -> list[float]:
    llm = LLM(str(directory), dtype="float32", block_size=16, max_model_len=64,
              speculative_tokens=3, return_draft_confidences=True)  # fmt: skip
    runner = llm._core.executor
    if graphs:  # what the loader installs on CUDA, uncaptured
        runner.drafter.graphs = DraftGraphs(runner.model, runner.cache, 3, max_requests=2,
                                            capture=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[[40, 41, 42, 43]], sampling_params=params,
                          use_tqdm=False)  # fmt: skip
    if graphs:
        assert (1, True) in runner.drafter.graphs.graphs, "no proposal ran on the draft graph"
    return [c for step in out.metrics.draft_confidences for c in step]


@pytest.mark.parametrize("graphs", [False, True])
def test_confidences_follow_the_checkpoint_temperature(
    dspark_checkpoint, tmp_path, monkeypatch, graphs
):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    plain = _confidences(dspark_checkpoint, graphs)
    hot = _confidences(_with_temperature(dspark_checkpoint, tmp_path / "t2", 2.0), graphs)
    assert len(plain) == len(hot) > 0
    for c1, c2 in zip(plain, hot):
        logit1, logit2 = math.log(c1 / (1 - c1)), math.log(c2 / (1 - c2))
        assert logit2 == pytest.approx(logit1 / 2, rel=1e-4, abs=1e-5)
    assert any(abs(c1 - c2) > 1e-3 for c1, c2 in zip(plain, hot))
    with pytest.raises(ValueError, match="dspark_confidence_temperature"):
        _confidences(_with_temperature(dspark_checkpoint, tmp_path / "t0", 0.0))
