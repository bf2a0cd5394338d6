"""Structured outputs: compile service, matcher state (triggers, rollback) and sampling that
always yields text the independent validators accept."""

import json
import threading

import pytest
import torch

from deepinfer.sampling import (
    GrammarCompilerService,
    GrammarError,
    GrammarSpec,
    SamplingParams,
    StructuredOutputState,
    allocate_token_bitmask,
    sample,
)
from deepinfer.sampling.compiler import FAILED, PENDING, READY
from deepinfer.sampling.testing import byte_level_tokenizer, check_json_schema
from deepinfer.sampling.testing_grammars import (
    EBNF_GRAMMARS,
    JSON_SCHEMAS,
    REGEXES,
    regex_accepts,
)

MAX_STEPS = 400


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def service(tokenizer):
    service = GrammarCompilerService.from_tokenizer(tokenizer, vocab_size=len(tokenizer))
    yield service
    service.shutdown()


def _generate(service, tokenizer, specs, seed):
    """Sample every spec's row from random logits under its grammar mask until it terminates."""
    states = [StructuredOutputState(service.compile(spec)) for spec in specs]
    vocab = service.vocab_size
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_token_bitmask(len(specs), vocab)
    params = [SamplingParams(seq_seed=seed * 1000 + i, temperature=1.0) for i in range(len(specs))]
    outputs = [[] for _ in specs]
    for step in range(MAX_STEPS):
        live = [i for i, s in enumerate(states) if not s.is_terminated()]
        if not live:
            break
        for i in live:
            states[i].fill_bitmask(bitmask, i)
        logits = torch.randn(len(specs), vocab, generator=gen) * 2.0
        tokens = sample(logits, params, [step] * len(specs), bitmask=bitmask).token_ids.tolist()
        for i in live:
            assert states[i].accept_token(tokens[i]), f"{specs[i]}: sampled a rejected token"
            outputs[i].append(tokens[i])
    unfinished = [specs[i].source for i, s in enumerate(states) if not s.is_terminated()]
    assert not unfinished, f"did not terminate within {MAX_STEPS} tokens: {unfinished}"
    eos = tokenizer.eos_token_id
    return [tokenizer.decode([t for t in out if t != eos]) for out in outputs]


@pytest.mark.parametrize("seed", [0, 1])
def test_thirty_json_schemas_always_yield_valid_json(service, tokenizer, seed):
    assert len(JSON_SCHEMAS) == 30
    specs = [GrammarSpec("json", json.dumps(s)) for s in JSON_SCHEMAS]
    texts = _generate(service, tokenizer, specs, seed)
    for schema, text in zip(JSON_SCHEMAS, texts):
        # strict=False: xgrammar 0.2.9 lets raw control characters into strings that carry
        # minLength/maxLength (its rule is [^"\\\r\n], unlike its [^\0-\x1f"\\] for plain
        # strings); everything else about the text must be valid JSON for the schema.
        value = json.loads(text, strict=False)
        assert check_json_schema(value, schema) == [], (schema, text)


def test_regexes_and_ebnf_grammars_always_yield_accepted_text(service, tokenizer):
    specs = [GrammarSpec("regex", r) for r in REGEXES]
    specs += [GrammarSpec("ebnf", g) for g, _ in EBNF_GRAMMARS]
    checkers = list(REGEXES) + [r for _, r in EBNF_GRAMMARS]
    for seed in (0, 1, 2):
        texts = _generate(service, tokenizer, specs, seed)
        for pattern, text in zip(checkers, texts):
            assert regex_accepts(pattern, text), (pattern, text)


def _mask_after(state, bitmask):
    state.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def test_rollback_restores_the_matcher_exactly(service, tokenizer):
    schema = JSON_SCHEMAS[17]
    state = StructuredOutputState(service.compile(GrammarSpec("json", json.dumps(schema))))
    text = '{"user": {"name": "ab", "roles": ["dev", "ops"]}}'
    tokens = tokenizer.encode(text) + [tokenizer.eos_token_id]
    bitmask = allocate_token_bitmask(1, service.vocab_size)
    masks = [_mask_after(state, bitmask)]
    for token in tokens:
        assert state.accept_token(token)
        masks.append(_mask_after(state, bitmask))
    assert state.is_terminated()
    for back in (1, 3, 7):  # undo `back` tokens, check the mask, replay them
        state.rollback(back)
        assert torch.equal(_mask_after(state, bitmask), masks[len(tokens) - back])
        assert state.accept_tokens(tokens[len(tokens) - back :]) == back
    # a rejected token leaves the state unchanged
    state.rollback(5)
    before = _mask_after(state, bitmask)
    bad = next(t for t in range(service.vocab_size) if not (before[t // 32] >> (t % 32)) & 1)
    assert not state.accept_token(bad)
    assert torch.equal(_mask_after(state, bitmask), before)
    with pytest.raises(ValueError, match="rollback"):
        state.rollback(state.max_rollback_tokens + 1)


def test_draft_masks_stop_at_the_first_rejected_draft(service, tokenizer):
    state = StructuredOutputState(service.compile(GrammarSpec("regex", "(ab)+c")))
    a, b, c = (tokenizer.convert_tokens_to_ids(x) for x in "abc")
    bitmask = allocate_token_bitmask(5, service.vocab_size)
    bitmask[4].fill_(7)  # must be left alone
    filled = state.fill_draft_bitmasks(bitmask, 0, [a, b, b, a])
    assert filled == 3  # rows 0..2: before a, after a, after ab; the second b is rejected
    allowed = [[t for t in (a, b, c) if (bitmask[r, t // 32] >> (t % 32)) & 1] for r in range(3)]
    assert allowed == [[a], [b], [a, c]]
    assert bitmask[4].eq(7).all() and state.accept_token(a)  # the state was rolled back


def test_trigger_then_grammar_and_bound_token_forcing(service, tokenizer):
    compiled = service.compile(GrammarSpec("regex", "[0-9]+"))
    x, y, z, seven = (tokenizer.convert_tokens_to_ids(t) for t in "xyz7")
    bitmask = allocate_token_bitmask(1, service.vocab_size)

    def allowed():
        return [t for t in range(service.vocab_size) if (bitmask[0, t // 32] >> (t % 32)) & 1]

    state = StructuredOutputState(compiled, trigger_token_ids=[x, y, x, z], bound_token_id=None)
    for token in (x, y, x, y, x):  # KMP: "xyxyx" ends with a partial match "xyx"
        assert not state.fill_bitmask(bitmask, 0) and state.accept_token(token)
    assert state.phase == "free" and state.accept_token(z)
    assert state.phase == "grammar" and state.fill_bitmask(bitmask, 0)
    assert seven in allowed() and x not in allowed()
    state.rollback(1)
    assert state.phase == "free"

    bound = StructuredOutputState(compiled, trigger_token_ids=[x, y, z], bound_token_id=x)
    assert bound.accept_token(seven) and bound.accept_token(x) and bound.phase == "forcing"
    bound.fill_bitmask(bitmask, 0)
    assert allowed() == [y]
    assert not bound.accept_token(z)
    assert bound.accept_token(y) and bound.fill_bitmask(bitmask, 0) and allowed() == [z]
    assert bound.accept_token(z) and bound.phase == "grammar"
    bound.rollback(3)
    assert bound.phase == "free"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json", "{not json"), "Failed to parse JSON"),
        (GrammarSpec("regex", "(ab"), "parenthesis"),
        (GrammarSpec("ebnf", "root ::= undefined_rule"), "not defined"),
    ],
)
def test_invalid_grammars_fail_alone_with_the_compiler_message(service, spec, message):
    bad = service.submit(spec)
    good = service.submit(GrammarSpec("regex", "[a-z]{3}"))
    with pytest.raises(GrammarError, match=message):
        bad.wait()
    assert bad.status() == FAILED and message in bad.error
    assert good.wait() is not None and good.status() == READY and good.error is None


class _BlockingService(GrammarCompilerService):
    """A service whose compiles wait for an event, to test the deadline deterministically."""

    def __init__(self, *args, release: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = release

    def _compile(self, spec):
        self.release.wait(10)
        return super()._compile(spec)


def test_compile_timeout_fails_only_that_request(service):
    release = threading.Event()
    slow = _BlockingService(service.tokenizer_info, timeout_s=0.2, release=release)
    try:
        pending = slow.submit(GrammarSpec("regex", "a+"))
        assert pending.status() == PENDING and pending.error is None
        with pytest.raises(GrammarError, match="did not compile within 0.2 s"):
            pending.wait()
        assert pending.status() == FAILED
        assert service.compile(GrammarSpec("regex", "b+")) is not None  # others unaffected
    finally:
        release.set()
        slow.shutdown()


def test_timeout_defaults_to_the_environment(monkeypatch, service):
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "3.5")
    assert GrammarCompilerService(service.tokenizer_info).timeout_s == 3.5
    with pytest.raises(ValueError, match="timeout_s"):
        GrammarCompilerService(service.tokenizer_info, timeout_s=0)


class _InlinePool:
    """An executor that finishes each job before ``submit`` returns (a compile that wins the
    race against ``add_done_callback``)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, **kwargs):
        pass


def test_submit_of_an_already_finished_compile_does_not_deadlock(service):
    inline = GrammarCompilerService(service.tokenizer_info)
    inline._pool = _InlinePool()
    results = []
    worker = threading.Thread(
        target=lambda: results.append(inline.submit(GrammarSpec("regex", "[0-9]{2}")).status()),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=20)
    assert results == [READY], "submit() deadlocked on a compile that finished immediately"
    assert inline._in_flight == {}


def test_choice_matches_exactly_its_strings(service, tokenizer):
    from deepinfer.sampling import StructuredOutputs

    choices = ["a b", "x-y", "#tag", "a&b", 'say "hi"', "back\\slash", "(p|q)*", "1.5", "[z]"]
    compiled = service.compile(StructuredOutputs(choice=choices).to_spec())
    for text in choices + ["a", "x", "(p|q)", "105"]:
        state = StructuredOutputState(compiled)
        ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        accepted = state.accept_tokens(ids) == len(ids) and state.is_terminated()
        assert accepted == (text in choices), text


def test_batched_mask_fill_equals_one_by_one(service, tokenizer):
    from deepinfer.sampling import fill_bitmasks

    x, y = (tokenizer.convert_tokens_to_ids(t) for t in "xy")
    specs = [GrammarSpec("json", json.dumps(s)) for s in JSON_SCHEMAS[:6]]
    states = [StructuredOutputState(service.compile(spec)) for spec in specs]
    states.append(StructuredOutputState(service.compile(specs[0]), trigger_token_ids=[x, y]))
    states[1].accept_tokens(tokenizer.encode('{"ok": '))
    rows = [6, 0, 5, 1, 4, 3, 2]
    batched = allocate_token_bitmask(7, service.vocab_size).zero_()
    fill_bitmasks(states, batched, rows)
    one_by_one = allocate_token_bitmask(7, service.vocab_size).zero_()
    for state, row in zip(states, rows):
        state.fill_bitmask(one_by_one, row)
    assert torch.equal(batched, one_by_one)
    assert (batched[rows[-1]] == -1).all()  # the trigger row is free
