"""Structured outputs with speculation: every draft position is masked and verified with the
matcher advanced over the earlier drafts, so greedy and seeded outputs equal a run without
speculation, every output is a valid prefix of the grammar (finished ones parse), grammar-
invalid drafts are rejected, rollback stays within ``DEEPINFER_MAX_BACKTRACKING_TOKENS``, and a
bad schema fails its request alone."""

from __future__ import annotations

import json

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.grammar import tokenizer_info
from deepinfer.engine.testing.oracle_drafts import OracleDraftSource
from deepinfer.sampling import (
    GrammarCompilerService,
    SamplingParams,
    StructuredOutputs,
    StructuredOutputState,
)

K = 3
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), dtype="float32", block_size=16, max_model_len=200, **kwargs)


def _json_params() -> list[SamplingParams]:
    so = StructuredOutputs(json=SCHEMA)
    return [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, structured_outputs=so),
        SamplingParams(temperature=0.8, top_p=0.9, seed=9, max_tokens=24, structured_outputs=so),
        SamplingParams(temperature=1.0, max_tokens=24, structured_outputs=so),  # rejection
    ]


def _assert_valid(llm: LLM, outputs) -> None:
    """Every output token is accepted by a fresh matcher; finished outputs parse."""
    tokenizer = llm.get_tokenizer()
    service = GrammarCompilerService(tokenizer_info(tokenizer, llm._vocab_size))
    compiled = service.compile(_json_params()[0].grammar_spec)
    for o in outputs:
        c = o.outputs[0]
        state = StructuredOutputState(compiled)
        assert state.accept_tokens(c.token_ids) == len(c.token_ids), c.token_ids
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text, strict=False)["a"], int)


def test_json_outputs_with_speculation_are_valid_and_exact(dspark_checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    prompts = ["x", "y", "z", "w"]
    params = _json_params()
    plain = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompts, params, use_tqdm=False
    )
    llm = _engine(dspark_checkpoint, speculative_tokens=K)
    spec = llm.generate(prompts, params, use_tqdm=False)
    _assert_valid(llm, spec)
    ids = [o.outputs[0].token_ids for o in spec]
    assert ids[:3] == [o.outputs[0].token_ids for o in plain[:3]]  # greedy and seeded
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0


def test_grammar_invalid_drafts_are_rejected(dspark_checkpoint, monkeypatch):
    """Oracle drafts of the plain run, every third one spoiled (often into a token the grammar
    forbids); a small backtracking limit caps the drafts per step."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_MAX_BACKTRACKING_TOKENS", "4")
    prompts = ["x", "y", "z"]
    params = _json_params()[:3]
    plain = _engine(dspark_checkpoint, speculative_tokens=0).generate(
        prompts, params, use_tqdm=False
    )
    llm = _engine(dspark_checkpoint, speculative_tokens=K, return_draft_confidences=True)
    tokenizer = llm.get_tokenizer()
    reference = {
        str(i): tokenizer.encode(p) + o.outputs[0].token_ids
        for i, (p, o) in enumerate(zip(prompts, plain))
    }
    assert all(len(tokenizer.encode(p)) == len(o.prompt_token_ids) for p, o in zip(prompts, plain))
    runner = llm._core.executor
    runner.drafter = OracleDraftSource(
        reference, K, runner.model.config.vocab_size, lambda r, pos: pos % 3 == 0
    )
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    _assert_valid(llm, spec)
    for o in spec:
        # rollback of (this step's tokens + drafts) <= 4: at most 4 - 1 drafts, fewer after
        # a step that emitted several tokens
        assert all(len(step) <= 3 for step in o.metrics.draft_confidences)
        assert o.metrics.num_accepted_tokens < o.metrics.num_draft_tokens


def test_bad_schema_fails_alone_with_speculation(dspark_checkpoint):
    llm = _engine(dspark_checkpoint, speculative_tokens=K)
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputs(regex="(unclosed"))
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(["a", "b", "c"], [good, bad, good], use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error" and outputs[1].outputs[0].error
    for o in (outputs[0], outputs[2]):
        assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8
        assert o.metrics.num_verify_steps > 0
