"""Asynchronous scheduling over the real model runner (tiny V4.1 checkpoint, batch-invariant
mode): a mixed batch (greedy, seeded, n > 1, stop strings, logprobs, a JSON schema) gives the
same outputs with it on and off, with and without speculation; no output runs past its stop;
the runner reads plain steps back only when asked (``execute_async``)."""

from __future__ import annotations

import json

from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.async_step import PendingStep
from deepinfer.sampling import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PROMPTS = ["def main():", "import os", "hello world hello", "x", "y = 1", "{"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2),
        SamplingParams(temperature=0.7, seed=4, max_tokens=9, stop=["a", "e"]),
        SamplingParams(temperature=0, max_tokens=5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=9, stop=["\n", "o"]),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputs(json=SCHEMA)),
    ]  # fmt: skip


def _run(directory, **kwargs):
    llm = LLM(str(directory), dtype="float32", block_size=16, max_model_len=128, **kwargs)
    outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return llm, [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def test_async_scheduling_changes_no_output(dspark_checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    _, sync = _run(dspark_checkpoint, speculative_tokens=0, async_scheduling=False)
    llm, ahead = _run(dspark_checkpoint, speculative_tokens=0, async_scheduling=True)
    assert llm._core.async_scheduling and ahead == sync
    _, spec_ahead = _run(dspark_checkpoint, speculative_tokens=3, async_scheduling=True)
    assert spec_ahead == sync
    for (tokens, text, _), params in zip([s[0] for s in sync], _params()):
        assert len(tokens) <= params.max_tokens
        for stop in params.stop or []:
            assert stop not in text  # cut at the first stop string, nothing past it
    tokens, text, reason = sync[5][0]
    if reason == "stop":  # the grammar's end: the object parses
        assert isinstance(json.loads(text)["a"], int)


def test_tokens_fed_on_the_device_change_no_output(dspark_checkpoint, monkeypatch):
    """Requests that read no history take the previous step's tokens as input on the device
    (greedy, seeded, stop strings, logprobs, n > 1, a penalised one beside them): outputs
    equal the synchronous loop's, and most steps were fed."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    params = [p for p in _params() if p.structured_outputs is None]
    params.append(SamplingParams(temperature=0, max_tokens=6, presence_penalty=0.5))
    prompts = PROMPTS[: len(params)]
    fed = []
    original = PendingStep.fed_inputs

    def counted(self, plan, device):
        feed = original(self, plan, device)
        fed.append(feed is not None)
        return feed

    def run(async_scheduling):
        llm = LLM(str(dspark_checkpoint), dtype="float32", block_size=16, max_model_len=128,
                  speculative_tokens=0, async_scheduling=async_scheduling)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        state = llm._core.executor.state  # nothing kept for finished requests
        assert set(state.last_sampled) <= set(state.sequences)
        return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
                for o in outputs]  # fmt: skip

    monkeypatch.setattr(PendingStep, "fed_inputs", counted)
    sync = run(False)
    assert not fed, "the synchronous loop fed a step"
    assert run(True) == sync
    assert sum(fed) >= 3, f"too few steps fed on the device: {fed}"


def test_plain_steps_are_read_back_on_result(dspark_checkpoint):
    llm = LLM(str(dspark_checkpoint), dtype="float32", block_size=16, max_model_len=64,
              speculative_tokens=0)  # fmt: skip
    runner = llm._core.executor
    scheduler = llm._core.scheduler
    llm._submit(None, SamplingParams(temperature=0, max_tokens=4), [[30, 31, 32]])
    first = scheduler.schedule()
    pending = runner.execute_async(first)
    assert not pending.is_done  # the prefill's token is not read yet
    second = scheduler.schedule()  # scheduled before the first step's token is known
    assert second.from_previous_sample == {"0"} and isinstance(second, SchedulerOutput)
    following = runner.execute_async(second)
    # the second step took the first one's token as input on the device, unread
    assert not pending.is_done and not following.is_done
    (token,) = pending.result().sampled_token_ids["0"]
    assert runner.state.sequences["0"].token_ids[-1] == token  # the placeholder set right
    scheduler.update(first, pending.result())
    scheduler.update(second, following.result())
    assert len(scheduler.requests["0"].output_token_ids) == 2


def test_a_penalised_request_reads_its_token_before_the_next_step(dspark_checkpoint):
    """A request whose next step reads its history (a repetition penalty) waits for the
    token on the host; its placeholder is never fed on the device."""
    llm = LLM(str(dspark_checkpoint), dtype="float32", block_size=16, max_model_len=64,
              speculative_tokens=0)  # fmt: skip
    runner, scheduler = llm._core.executor, llm._core.scheduler
    params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3)
    llm._submit(None, params, [[30, 31, 32]])
    first = scheduler.schedule()
    pending = runner.execute_async(first)
    second = scheduler.schedule()
    assert second.from_previous_sample == {"0"}
    runner.execute_async(second)
    assert pending.is_done
    (token,) = pending.result().sampled_token_ids["0"]
    assert runner.state.sequences["0"].token_ids[-1] == token
