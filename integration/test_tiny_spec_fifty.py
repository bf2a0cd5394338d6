"""Speculation on the shipped tiny model is exact for 50 Python prompts: greedy outputs with
DSpark drafting (fixed 5 and confidence-scheduled) are token-identical to a run without it, in
batch-invariant mode, on the CPU reference backend (8 tokens each; the confidence-scheduled run
plans on a GPU-shaped step-cost curve, since the CPU's own would verify few drafts) and on an
NVIDIA GPU when there is one (16 tokens each, the curve measured at start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.testing import python_prompts
from deepinfer.spec import StepCostCurve

CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "tiny_model" / "checkpoint"
PROMPTS = python_prompts()
ACCELERATORS = [
    "cpu",
    pytest.param("nvidia", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    ]),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_fifty_prompts_identical_with_and_without_speculation(monkeypatch, accelerator):
    assert len(set(PROMPTS)) == 50
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    common = dict(accelerator=accelerator, dtype="float32", max_num_seqs=50, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    varlen = dict(speculative_tokens=5, spec_varlen=True)
    if accelerator == "nvidia":
        common["gpu_memory_utilization"] = 0.3
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    else:  # a step of 300 tokens costs 1.3x a step of one, as on a GPU
        varlen["spec_cost_curve"] = StepCostCurve.from_points([(1, 1.0), (300, 1.3)])

    def run(**kwargs):
        llm = LLM(str(CHECKPOINT), **common, **kwargs)
        return llm.generate(PROMPTS, greedy, use_tqdm=False)

    plain = [o.outputs[0].token_ids for o in run(speculative_tokens=0)]
    for kwargs in (dict(speculative_tokens=5), varlen):
        outputs = run(**kwargs)
        assert [o.outputs[0].token_ids for o in outputs] == plain, kwargs
        steps = sum(o.metrics.num_verify_steps for o in outputs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
        # drafts do get accepted (>= 2 tokens per step over longer runs: test_tiny_checkpoint;
        # here the last step of each short request is capped by max_tokens)
        assert (accepted + steps) / steps >= 1.5, (kwargs, accepted, steps)
