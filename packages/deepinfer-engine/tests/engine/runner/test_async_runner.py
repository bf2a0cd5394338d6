"""Asynchronous scheduling over the real model runner (tiny V4.1 checkpoint, batch-invariant
mode): a mixed batch (greedy, seeded, n > 1, stop strings, logprobs, a JSON schema) gives the
same outputs with it on and off, with and without speculation; no output runs past its stop;
the runner reads plain steps back only when asked (``execute_async``)."""

from __future__ import annotations

import json

from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.frontend.llm import LLM
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
    assert pending.is_done  # the second step needed its token as input
    (token,) = pending.result().sampled_token_ids["0"]
    assert runner.state.sequences["0"].token_ids[-1] == token
    scheduler.update(first, pending.result())
    scheduler.update(second, following.result())
    assert len(scheduler.requests["0"].output_token_ids) == 2
