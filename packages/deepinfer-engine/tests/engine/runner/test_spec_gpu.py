"""Speculative decoding on the GPU (skipped without CUDA): greedy and seeded outputs with
fixed-K and confidence-scheduled verification equal a run without speculation (batch-invariant
mode), and rejection-mode requests complete with consistent metrics.

    .venv/bin/python -m pytest packages/deepinfer-engine/tests/engine/runner/test_spec_gpu.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _engine(directory, **kwargs) -> LLM:
    return LLM(
        str(directory), accelerator="nvidia", dtype="float32", block_size=16,
        max_model_len=256, gpu_memory_utilization=0.3, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_speculation_is_exact(dspark_checkpoint, monkeypatch, varlen):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    gen = random.Random(0)
    prompts = [[gen.randrange(20, 250) for _ in range(gen.randrange(3, 60))] for _ in range(50)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 25 + [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=i)
        for i in range(25)
    ]
    plain = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    spec = _engine(dspark_checkpoint, speculative_tokens=3, spec_varlen=varlen).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0


def test_gpu_rejection_mode_runs(dspark_checkpoint):
    llm = _engine(dspark_checkpoint, speculative_tokens=3, spec_acceptance="rejection")
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    outputs = llm.generate(prompt_token_ids=[[30, 31, 32]] * 16, sampling_params=params,
                           use_tqdm=False)  # fmt: skip
    for o in outputs:
        m = o.metrics
        assert len(o.outputs[0].token_ids) == 12 and m.num_accepted_tokens <= m.num_draft_tokens
