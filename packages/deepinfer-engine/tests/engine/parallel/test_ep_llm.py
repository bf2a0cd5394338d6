"""EPLB through ``LLM``: two expert-parallel ranks with a redundant slot each, rebalancing every
two steps while they generate, give the single-process outputs token for token and logprob for
logprob (greedy and seeded, batch-invariant kernels)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.sampling import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_v4_config(n_routed_experts=8, num_experts_per_tok=3)
    directory = tmp_path_factory.mktemp("eplb-llm")
    return make_random_checkpoint(
        directory, config, quantized=False, seed=4, float_dtype=torch.float32
    )


def _outputs(checkpoint, **parallel):
    rng = random.Random(1)
    prompts = [[rng.randrange(20, 500) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seq_seed=i, max_tokens=5, ignore_eos=True, logprobs=2
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=128, speculative_tokens=0, **parallel)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_eplb_while_generating_changes_no_output(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    parallel = _outputs(
        checkpoint,
        data_parallel_size=2,
        expert_parallel_size=2,
        num_redundant_experts=1,
        eplb_interval=2,
        eplb_window=4,
    )
    assert parallel == _outputs(checkpoint)
