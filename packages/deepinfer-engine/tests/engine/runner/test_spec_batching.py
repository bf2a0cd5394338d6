"""Speculation mixed with the rest of the scheduler: verification shares steps with prefill
chunks under a small token budget (which may also cut a request's drafts), ``n > 1`` forks copy
the draft windows with the state slot, and preemption drops drafts; outputs stay those of a run
without speculation (batch-invariant mode)."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _engine(directory, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 96)
    return LLM(str(directory), dtype="float32", block_size=16, **kwargs)


def _prompts(count: int) -> list[list[int]]:
    gen = random.Random(5)
    return [[gen.randrange(20, 250) for _ in range(gen.randrange(3, 40))] for _ in range(count)]


def _ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_small_budget_chunks_prefills_beside_verification(dspark_checkpoint):
    prompts = _prompts(10)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    llm = _engine(dspark_checkpoint, speculative_tokens=3, max_num_batched_tokens=20)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert sum(o.metrics.num_verify_steps for o in got) > 0


def test_forked_samples_and_preemption(dspark_checkpoint):
    prompts = _prompts(6)
    params = [
        SamplingParams(temperature=1.0, n=2, max_tokens=10, ignore_eos=True, seed=11),
        SamplingParams(temperature=0, n=3, max_tokens=10, ignore_eos=True),
    ] * 3
    want = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    got = _engine(dspark_checkpoint, speculative_tokens=3).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    assert _ids(got) == _ids(want)
    scarce = _engine(dspark_checkpoint, speculative_tokens=3, num_cache_blocks=6, max_model_len=96)
    outputs = scarce.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _ids(outputs) == _ids(want)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "no preemption was forced"
