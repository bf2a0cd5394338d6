"""The LLM API shell over fake executors (no model)."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.frontend.validation import InvalidRequestError
from deepinfer.engine.testing.fake_executor import (
    HashModelExecutor,
    ScriptedExecutor,
    fake_loaded_model,
    reference_generate,
)
from deepinfer.engine.tokenizer import testing_tokenizer
from deepinfer.sampling import SamplingParams


class FakeLLM(LLM):
    """``LLM`` whose model is a fake executor (``executor_factory(config, tokenizer)``)."""

    def __init__(self, executor_factory=None, num_blocks=256, **kwargs):
        self._factory = executor_factory
        self._num_blocks = num_blocks
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("max_num_seqs", 16)
        super().__init__("fake-model", **kwargs)

    def _load_executor(self, config: EngineConfig):
        tokenizer = testing_tokenizer()
        executor = self._factory(config, tokenizer, self._num_blocks) if self._factory else None
        return fake_loaded_model(config, tokenizer, num_blocks=self._num_blocks, executor=executor)


def scripted(text: str):
    def factory(config, tokenizer, num_blocks):
        return ScriptedExecutor(
            num_blocks,
            config.block_size,
            config.max_num_seqs + 1,
            vocab_size=tokenizer.vocab_size,
            script=tokenizer.encode(text, add_bos=False),
            eos_token_id=tokenizer.eos_token_id,
        )

    return factory


PROMPTS = ["def main():", "import os", "hello wörld, this is a longer prompt " * 3, "x"]


def test_generate_matches_the_plain_loop_in_input_order():
    llm = FakeLLM(max_num_batched_tokens=8)
    tok = llm.get_tokenizer()
    params = [
        SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seq_seed=s)
        for t, m, s in [(0.0, 5, 1), (0.7, 9, 2), (1.0, 3, 3), (0.0, 12, 4)]
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    for prompt, p, out in zip(PROMPTS, params, outputs):
        ids = tok.encode(prompt)
        expected = reference_generate(ids, p, p.seq_seed, tok.vocab_size, p.max_tokens)
        (sample,) = out.outputs
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert sample.token_ids == expected and sample.finish_reason == "length"
        assert sample.text == tok.decode(expected, skip_special_tokens=True)
        assert out.metrics.num_generated_tokens == p.max_tokens
        assert out.metrics.time_to_first_token >= 0


def test_seeded_sampling_is_the_same_alone_and_inside_a_batch_of_32():
    llm = FakeLLM(max_num_batched_tokens=64, num_blocks=30)
    p = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seq_seed=1234)
    alone = llm.generate("the same prompt", p, use_tqdm=False)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = [rng.choice(PROMPTS) + str(i) for i in range(32)]
    batch = [*others[:16], "the same prompt", *others[16:]]
    params = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 33
    params[16] = p
    outputs = llm.generate(batch, params, use_tqdm=True)
    assert outputs[16].outputs[0].token_ids == alone
    assert llm._core.scheduler.num_preemptions > 0  # the small cache really was contended


def test_unseeded_requests_get_seeds_from_the_engine_seed():
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in FakeLLM(seed=5).generate(PROMPTS, p, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in FakeLLM(seed=5).generate(PROMPTS, p, use_tqdm=False)]
    other = [o.outputs[0].token_ids for o in FakeLLM(seed=6).generate(PROMPTS, p, use_tqdm=False)]
    assert first == again and first != other


def test_stop_strings_cut_the_text_in_generate_and_stream():
    llm = FakeLLM(executor_factory=scripted("Hello there STOP and more"))
    p = SamplingParams(max_tokens=50, stop=["STOP"])
    (out,) = llm.generate("hi", p, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.text == "Hello there " and sample.finish_reason == "stop"
    assert sample.stop_reason == "STOP"
    deltas = list(llm.stream("hi", p))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    streamed = "".join(c.text for d in deltas for c in d.outputs)
    assert streamed == "Hello there "
    assert [t for d in deltas for c in d.outputs for t in c.token_ids] == sample.token_ids


def test_eos_finishes_with_stop_and_max_tokens_with_length():
    llm = FakeLLM(executor_factory=scripted("abc"))
    eos_out, len_out = llm.generate(
        ["a", "b"], [SamplingParams(max_tokens=10), SamplingParams(max_tokens=2)], use_tqdm=False
    )
    assert eos_out.outputs[0].finish_reason == "stop" and eos_out.outputs[0].text == "abc"
    assert eos_out.outputs[0].token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert len_out.outputs[0].finish_reason == "length"


def test_n_samples_come_back_as_one_request():
    llm = FakeLLM()
    p = SamplingParams(temperature=1.0, n=3, max_tokens=8, ignore_eos=True, seq_seed=7)
    (out,) = llm.generate("fork me", p, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_chat_parses_reasoning_and_content():
    llm = FakeLLM(executor_factory=scripted("I should add.</think>It is 4."))
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=40), thinking=True, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.reasoning_content == "I should add." and sample.content == "It is 4."
    assert sample.tool_calls == []
    assert out.prompt_token_ids == llm.get_tokenizer().encode_chat(conversation, thinking=True)
    assert out.prompt.endswith("What is 2+2?<｜Assistant｜><think>")
    with pytest.raises(InvalidRequestError, match="request 1: .*role"):
        llm.chat([conversation, [{"role": "robot", "content": "hi"}]], use_tqdm=False)


def test_bad_inputs_raise_before_any_work_naming_the_request():
    llm = FakeLLM(max_model_len=64)
    executor = llm._core.executor
    cases = [
        (dict(prompts=["ok", ""]), "request 1: the prompt is empty"),
        (dict(prompt_token_ids=[[1, 2], [3, 99999]]), "request 1: prompt token 1 is 99999"),
        (dict(prompt_token_ids=[[5] * 10, [5] * 64]), "request 1: the prompt has 64 tokens"),
        (
            dict(prompts=["a", "b"], sampling_params=[SamplingParams(), SamplingParams(n=99)]),
            "request 1: n=99",
        ),
        (
            dict(prompts=["a"], sampling_params=SamplingParams(stop_token_ids=[70000])),
            "request 0: stop_token_ids contains 70000",
        ),
        (dict(prompts=None), "give prompts or prompt_token_ids"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(use_tqdm=False, **kwargs)
    assert executor.num_steps == 0 and not llm._core.has_unfinished_requests()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_a_failing_request_fails_alone():
    def failing(config, tokenizer, num_blocks):
        return HashModelExecutor(
            num_blocks, config.block_size, config.max_num_seqs + 1, tokenizer.vocab_size, {"1"}
        )

    llm = FakeLLM(executor_factory=failing)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    p2 = SamplingParams(max_tokens=4, ignore_eos=True, n=2)  # fails before its samples fork
    outputs = llm.generate(["a", "b", "c"], [p, p2, p], use_tqdm=False)
    reasons = [[c.finish_reason for c in o.outputs] for o in outputs]
    assert reasons == [["length"], ["error", "error"], ["length"]]
    assert "simulated failure" in outputs[1].outputs[1].error


def test_abort_while_streaming():
    llm = FakeLLM()
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    finals = {}
    for delta in llm.stream(["keep", "drop"], p):
        if delta.request_id == "1" and not finals:
            llm.abort("1")
            finals["aborting"] = True
        if delta.finished:
            finals[delta.request_id] = delta.outputs[0].finish_reason
    assert finals["0"] == "length" and finals["1"] == "abort"
    assert not llm._core.has_unfinished_requests()


def test_constructor_validates_and_resolves(monkeypatch):
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        FakeLLM(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        FakeLLM(accelerator="tpu")
    with pytest.raises(ValueError, match="max_model_len=2000: the KV cache holds only 1020"):
        FakeLLM(max_model_len=2000, num_blocks=256)
    with pytest.raises(ValueError, match="max_model_len=5000: expected at most the model's"):
        FakeLLM(max_model_len=5000, num_blocks=2000)
    assert FakeLLM(num_blocks=100).config.max_model_len == 99 * 4
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/models/v4")
    assert LLM._load_executor is not FakeLLM._load_executor
    from deepinfer.engine.config import resolve_model

    assert resolve_model(None) == "/models/v4" and resolve_model("x/y") == "x/y"
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    assert resolve_model(None) == "deepseek-ai/DeepSeek-V4.1-Flash-1017"


def test_logprobs_and_prompt_logprobs_cover_every_token():
    from deepinfer.engine.testing.fake_executor import token_logprob

    llm = FakeLLM(max_num_batched_tokens=5)  # the prompt is computed in several chunks
    p = SamplingParams(
        temperature=1.0, n=2, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    (out,) = llm.generate("a prompt of some length", p, use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == [{t: token_logprob(t, i)} for i, t in enumerate(ids) if i]
    for sample in out.outputs:
        assert len(sample.logprobs) == len(sample.token_ids) == 6
        assert [next(iter(lp)) for lp in sample.logprobs] == sample.token_ids
    (plain,) = llm.generate("a prompt", SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None


def test_streaming_n_samples_reassembles_each_sample():
    llm = FakeLLM()
    p = SamplingParams(temperature=1.0, n=3, max_tokens=7, ignore_eos=True, seq_seed=3)
    (final,) = llm.generate("stream me", p, use_tqdm=False)
    tokens = {0: [], 1: [], 2: []}
    texts = {0: "", 1: "", 2: ""}
    for delta in llm.stream("stream me", p):
        for sample in delta.outputs:
            tokens[sample.index] += sample.token_ids
            texts[sample.index] += sample.text
    assert [tokens[k] for k in range(3)] == [c.token_ids for c in final.outputs]
    assert [texts[k] for k in range(3)] == [c.text for c in final.outputs]


def test_stream_chat_parses_incrementally():
    llm = FakeLLM(executor_factory=scripted("Let me think.</think>Four, of course."))
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    deltas = list(llm.stream_chat(conversation, SamplingParams(max_tokens=40), thinking=True))
    samples = [c for d in deltas for c in d.outputs]
    assert "".join(c.reasoning_content for c in samples) == "Let me think."
    assert "".join(c.content for c in samples) == "Four, of course."
    assert sum(1 for c in samples if c.content) > 1  # content arrived in several pieces


def test_stream_validates_on_call_and_closing_aborts():
    llm = FakeLLM()
    with pytest.raises(InvalidRequestError, match="request 0: the prompt is empty"):
        llm.stream("")
    stream = llm.stream(["a", "b"], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    llm._core.step()  # reports the aborts and frees the resources
    assert not llm._core.has_unfinished_requests()
    sched = llm._core.scheduler
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    never_iterated = llm.stream("c", SamplingParams(max_tokens=50, ignore_eos=True))
    del never_iterated  # dropping an unstarted stream aborts its requests too
    llm._core.step()
    assert not llm._core.has_unfinished_requests() and not llm._outputs._groups


def test_start_up_reports_cache_capacity(caplog):
    with caplog.at_level("INFO", logger="deepinfer.engine"):
        FakeLLM(num_blocks=51, max_num_seqs=7)
    (line,) = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert "50 blocks x 4 tokens = 200 tokens" in line and "max 7 sequences" in line
