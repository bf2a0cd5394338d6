"""Stop conditions and metrics with speculation: a stop token, stop string or ``max_tokens``
inside an accepted run of drafts ends the output exactly where a run without speculation
ends it, and the metrics count the truncated step consistently (emitted tokens = accepted
drafts + verify steps + plain steps)."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing.oracle_drafts import OracleDraftSource
from deepinfer.sampling import SamplingParams

K = 3


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), dtype="float32", block_size=16, max_model_len=160, **kwargs)


def _prompts() -> list[list[int]]:
    gen = random.Random(3)
    return [[gen.randrange(20, 250) for _ in range(gen.randrange(4, 12))] for _ in range(4)]


def _oracle_run(directory, prompts, reference_outputs, params):
    """A run whose drafts are always right: every verify step accepts all it verifies."""
    llm = _engine(directory, speculative_tokens=K)
    runner = llm._core.executor
    reference = {str(i): p + o for i, (p, o) in enumerate(zip(prompts, reference_outputs))}
    runner.drafter = OracleDraftSource(
        reference, K, runner.model.config.vocab_size, lambda r, pos: False
    )
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_stops_inside_an_accepted_run_truncate_it(dspark_checkpoint):
    prompts = _prompts()
    free = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = _engine(dspark_checkpoint, speculative_tokens=0)
    full = [o.outputs[0].token_ids for o in plain.generate(
        prompt_token_ids=prompts, sampling_params=free, use_tqdm=False)]  # fmt: skip
    # output index 2 and 6 sit inside the runs 1..4 and 5..8 of fully accepted steps
    stop_at = [2, 6, 2, 6]
    cases = [
        SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[full[i][j]])
        for i, j in enumerate(stop_at)
    ]
    cases[2] = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # max_tokens
    text = plain.get_tokenizer().decode(full[3])
    cases[3] = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=[text[4:6]])
    want = plain.generate(prompt_token_ids=prompts, sampling_params=cases, use_tqdm=False)
    got = _oracle_run(dspark_checkpoint, prompts, full, cases)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        m = g.metrics
        assert m.num_generated_tokens == len(g.outputs[0].token_ids)
        # every step after the prefill verified drafts; all were right until the stop
        assert m.num_generated_tokens == 1 + m.num_accepted_tokens + m.num_verify_steps
        assert m.num_accepted_tokens <= m.num_draft_tokens
    assert [o.outputs[0].finish_reason for o in want][:3] == ["stop", "stop", "length"]
    assert len(want[0].outputs[0].token_ids) == 3 and len(want[1].outputs[0].token_ids) <= 7


def test_metrics_add_up_with_the_dspark_drafter(dspark_checkpoint):
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = _engine(dspark_checkpoint, speculative_tokens=K, return_draft_confidences=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for o in outputs:
        m = o.metrics
        assert m.num_generated_tokens == 12
        assert 0 <= m.num_accepted_tokens <= m.num_draft_tokens
        plain_steps = m.num_generated_tokens - m.num_accepted_tokens - m.num_verify_steps
        assert 1 <= plain_steps <= 2  # the prefill's token, and a last step with no room
        assert len(m.draft_confidences) == m.num_verify_steps
        assert sum(len(c) for c in m.draft_confidences) == m.num_draft_tokens
        assert all(0.0 < c < 1.0 for step in m.draft_confidences for c in step)
        assert m.mean_accepted_length >= 1.0
    without = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    assert all(o.metrics.num_verify_steps == 0 and o.metrics.mean_accepted_length is None
               for o in without)  # fmt: skip
