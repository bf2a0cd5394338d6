"""Speculative decoding is exact: greedy (fixed-K and confidence-scheduled) and seeded sampling
give the tokens of a run without speculation, in batch-invariant mode; with an oracle draft
source the accept counts are exactly those the drafts imply, and rejected drafts leave no
trace in what later positions see."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.engine.testing.oracle_drafts import OracleDraftSource, expected_oracle_counts
from deepinfer.sampling import SamplingParams
from deepinfer.spec import StepCostCurve

BLOCK_SIZE = 16  # V4.1 ratios 1 and 2
K = 3  # the tiny checkpoint's dspark_block_size
MAX_TOKENS = 5


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _engine(directory, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 64)
    return LLM(str(directory), dtype="float32", block_size=BLOCK_SIZE, max_model_len=160, **kwargs)


def _prompts(count: int = 50, longest: int = 18) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(20, 250) for _ in range(rng.randrange(3, longest))] for _ in range(count)
    ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run(llm: LLM, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.slow
def test_greedy_with_speculation_equals_without(dspark_checkpoint):
    prompts = _prompts()
    plain = _tokens(_run(_engine(dspark_checkpoint, speculative_tokens=0), prompts, GREEDY))
    fixed = _run(_engine(dspark_checkpoint, speculative_tokens=K), prompts, GREEDY)
    assert _tokens(fixed) == plain
    assert sum(o.metrics.num_draft_tokens for o in fixed) > 0, "nothing was verified"
    # confidence scheduling on a curve where a row costs 1/3 of a step: ragged lengths
    curve = StepCostCurve.from_points([(1, 3.0), (400, 402.0)])
    varlen = _engine(
        dspark_checkpoint, spec_varlen=True, spec_cost_curve=curve, return_draft_confidences=True
    )
    outputs = _run(varlen, prompts, GREEDY)
    assert _tokens(outputs) == plain
    lengths = {len(step) for o in outputs for step in o.metrics.draft_confidences}
    assert len(lengths) > 1, f"every request verified the same number of drafts: {lengths}"


def _oracle_engine(directory, reference, is_corrupt, **kwargs) -> LLM:
    llm = _engine(directory, speculative_tokens=K, return_draft_confidences=True, **kwargs)
    runner = llm._core.executor
    runner.drafter = OracleDraftSource(reference, K, runner.model.config.vocab_size, is_corrupt)
    return llm


def _corrupt(request_id: str, position: int) -> bool:
    """Spoil about one draft in three, at positions that vary with the request."""
    return (position * 7 + int(request_id) * 3) % 11 < 4


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_oracle_drafts_accept_exactly_what_they_match(dspark_checkpoint, kind):
    prompts = _prompts(12, longest=40)
    max_tokens = 12
    if kind == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * 12
    else:  # seed-exact verification
        params = [
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, ignore_eos=True,
                           seed=100 + i, logprobs=2)
            for i in range(12)
        ]  # fmt: skip
    plain = _run(_engine(dspark_checkpoint, speculative_tokens=0), prompts, params)
    reference = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    spec = _run(_oracle_engine(dspark_checkpoint, reference, _corrupt), prompts, params)
    assert _tokens(spec) == _tokens(plain)
    rejected_at, full = set(), 0
    for i, (prompt, out) in enumerate(zip(prompts, spec)):
        want = expected_oracle_counts(
            len(prompt), max_tokens, K, lambda pos, i=i: _corrupt(str(i), pos)
        )
        m = out.metrics
        got = (m.num_draft_tokens, m.num_accepted_tokens, m.num_verify_steps)
        assert got == (want.num_draft_tokens, want.num_accepted_tokens, want.num_verify_steps)
        # emitted tokens = accepted drafts + one per verify step (+ one per plain step)
        assert m.num_generated_tokens == max_tokens
        assert max_tokens == m.num_accepted_tokens + m.num_verify_steps + want.num_plain_steps
        assert m.num_accepted_tokens <= m.num_draft_tokens
        assert m.mean_accepted_length == pytest.approx(
            1 + m.num_accepted_tokens / m.num_verify_steps
        )
        assert sum(len(c) for c in m.draft_confidences) == m.num_draft_tokens
        assert all(c == pytest.approx(0.9) for step in m.draft_confidences for c in step)
        rejected_at |= want.rejected_at
        full += want.num_full_accepts
    assert rejected_at == set(range(K)) and full > 0, "the corruption pattern misses a case"
    if kind == "seeded":  # logprobs of every emitted token: those of the plain run
        for got, want in zip(spec, plain):
            for g, w, t in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                               want.outputs[0].token_ids):  # fmt: skip
                assert g[t] == pytest.approx(w[t], abs=1e-5)


def test_penalties_and_bans_see_each_rows_drafts(dspark_checkpoint):
    """Rows of a verification step apply penalties and ``min_tokens`` bans over the generated
    tokens plus the drafts before them; plain rows in the same step share one history. Greedy
    and seeded requests with penalties, bans or neither, mixed in one batch, with oracle drafts
    (long accepted runs): the tokens of a run without speculation."""
    prompts = _prompts(12, longest=30)

    def settings(i: int) -> dict:
        sampled = dict(temperature=1.0, seed=40 + i) if i % 2 == 0 else dict(temperature=0)
        if i % 3 == 0:
            return dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.5,
                        **sampled)  # fmt: skip
        if i % 3 == 1:  # banned for the first 6 tokens, then stops on any of them
            return dict(min_tokens=6, stop_token_ids=tuple(range(20, 250, 3)), **sampled)
        return sampled

    params = [SamplingParams(max_tokens=12, ignore_eos=True, **settings(i)) for i in range(12)]
    plain = _run(_engine(dspark_checkpoint, speculative_tokens=0), prompts, params)
    reference = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    spec = _run(_oracle_engine(dspark_checkpoint, reference, _corrupt), prompts, params)
    assert _tokens(spec) == _tokens(plain)
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 30, "too few accepted drafts"
    unpenalised = _run(_engine(dspark_checkpoint, speculative_tokens=0), prompts,
                       [replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                                frequency_penalty=0.0) for p in params])  # fmt: skip
    assert _tokens(unpenalised) != _tokens(plain), "the penalties changed nothing"


def test_rejected_drafts_never_become_visible(dspark_checkpoint):
    """Every draft after the first of each block is garbage: the rows they wrote (window rings,
    ratio-2 compressor state, Engram history, compressed entries) are rewritten before any
    later position reads them, so logprobs equal those of a plain run."""
    prompts = _prompts(6, longest=40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    plain = _run(_engine(dspark_checkpoint, speculative_tokens=0), prompts, params)
    reference = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    spec = _run(
        _oracle_engine(dspark_checkpoint, reference, lambda r, pos: pos % 2 == 0), prompts, params
    )
    assert _tokens(spec) == _tokens(plain)
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in spec) > 20
    for got, want in zip(spec, plain):
        for g, w, t in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                           want.outputs[0].token_ids):  # fmt: skip
            assert g[t] == pytest.approx(w[t], abs=1e-5)


def test_v4_dspark_rejections_leave_no_trace(tmp_path):
    """A V4-0731-style checkpoint (overlapping ratio-4 and ratio-128 compressors): prompts end
    just before position 128, so rejected drafts complete the first ratio-128 entry (and
    ratio-4 entries) from garbage before the right tokens rewrite them."""
    config = tiny_v4_config(
        num_nextn_predict_layers=2, compress_ratios=[0, 4, 128, 4, 0, 0], dspark_block_size=3,
        dspark_noise_token_id=16, dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=32,
    )  # fmt: skip
    make_random_checkpoint(tmp_path, config, quantized=False, seed=0)
    gen = random.Random(2)
    prompts = [[gen.randrange(20, 250) for _ in range(n)] for n in (125, 126, 127, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)

    def engine(k):
        return LLM(str(tmp_path), dtype="float32", max_model_len=256, speculative_tokens=k)

    plain = _run(engine(0), prompts, params)
    reference = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    llm = engine(K)
    runner = llm._core.executor
    runner.drafter = OracleDraftSource(
        reference, K, runner.model.config.vocab_size, lambda r, pos: pos % 2 == 1
    )
    spec = _run(llm, prompts, params)
    assert _tokens(spec) == _tokens(plain)
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in spec) > 10
    for got, want in zip(spec, plain):
        for g, w, t in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                           want.outputs[0].token_ids):  # fmt: skip
            assert g[t] == pytest.approx(w[t], abs=1e-5)
