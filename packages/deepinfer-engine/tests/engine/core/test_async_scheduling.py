"""Asynchronous scheduling over the fake hash model: the next step is scheduled before the
previous one's tokens are known, and the outputs equal the synchronous loop's exactly."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deepinfer.engine.core import EngineCore, Request, Scheduler, SchedulerConfig
from deepinfer.engine.core.request import child_seed
from deepinfer.engine.testing.fake_executor import (
    ScriptedExecutor,
    build_engine_core,
    reference_generate,
    run_until_done,
)
from deepinfer.sampling import SamplingParams

VOCAB = 97

CONFIGS = {
    "roomy": SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=128, num_blocks=200,
        block_size=4, num_state_slots=65, compression_ratios=(1, 2, 4),
    ),
    "chunked": SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=7, max_model_len=128, num_blocks=200,
        block_size=4, num_state_slots=65, compression_ratios=(1, 2, 4),
    ),
    "preempting": SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128, num_blocks=24,
        block_size=4, num_state_slots=17, compression_ratios=(1, 2, 4),
    ),
}  # fmt: skip


def _requests(num: int, seed: int, greedy: bool, n_every: int = 0):
    rng = random.Random(seed)
    requests = {}
    for i in range(num):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            temperature=0.0 if greedy else 0.8,
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            n=3 if n_every and i % n_every == 0 else 1,
            seq_seed=rng.randrange(1 << 40),
        )
        requests[f"r{i}"] = (prompt, params)
    return requests


def _run(core, requests):
    for rid, (prompt, params) in requests.items():
        core.add_request(Request(rid, prompt, params, seed=params.seq_seed))
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    for update in run_until_done(core):
        key = (update.group_id, update.index)
        assert key not in finals, f"{key} reported tokens after it finished"
        tokens.setdefault(key, []).extend(update.new_token_ids)
        if update.finished:
            finals[key] = update.finish_reason
    sched = core.scheduler
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert sched.state_slots.num_free_slots == sched.state_slots.num_usable_slots
    return tokens, finals


class RecordingExecutor(ScriptedExecutor):
    """Records, per step, which requests took their input from the executor's last sample."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.from_previous: list[set[str]] = []
        self.sampled: dict[str, list[int]] = {}

    def execute(self, scheduler_output):
        self.from_previous.append(set(scheduler_output.from_previous_sample))
        out = super().execute(scheduler_output)
        for rid, tokens in out.sampled_token_ids.items():
            self.sampled.setdefault(rid, []).extend(tokens)
        return out


@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_async_outputs_equal_sync_and_the_plain_loop(config_name, greedy, drafts):
    config = replace(CONFIGS[config_name], num_lookahead_tokens=drafts)
    requests = _requests(24, seed=len(config_name) + drafts, greedy=greedy, n_every=5)
    runs = {}
    for async_scheduling in (False, True):
        core = build_engine_core(
            config, vocab_size=VOCAB, num_draft_tokens=drafts, async_scheduling=async_scheduling
        )
        runs[async_scheduling] = _run(core, requests)
    assert runs[True] == runs[False]
    tokens, finals = runs[True]
    for rid, (prompt, params) in requests.items():
        for k in range(params.n):
            seed = child_seed(params.seq_seed, k)
            expected = reference_generate(prompt, params, seed, VOCAB, params.max_tokens)
            assert tokens[(rid, k)] == expected
            assert finals[(rid, k)] == "length"


def test_the_next_step_runs_before_the_previous_tokens_are_known():
    config = CONFIGS["roomy"]
    executor = RecordingExecutor(
        config.num_blocks, config.block_size, config.num_state_slots, vocab_size=VOCAB,
        script=list(range(10, 30)),
    )  # fmt: skip
    core = EngineCore(Scheduler(config), executor, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        core.add_request(Request(f"r{i}", [5 + i] * (3 + i), params, seed=i))
    run_until_done(core)
    # step 1 prefills; every later step decodes from the previous step's samples
    assert executor.from_previous[0] == set()
    assert all(ids == {f"r{i}" for i in range(4)} for ids in executor.from_previous[1:7])
    assert core.num_steps == 8  # no step lost waiting for the host


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nothing_past_eos_or_max_tokens_and_the_extra_step_is_dropped(async_scheduling):
    config = CONFIGS["roomy"]
    eos = 1
    executor = RecordingExecutor(
        config.num_blocks, config.block_size, config.num_state_slots, vocab_size=VOCAB,
        script=[10, 11, 12], eos_token_id=eos,
    )  # fmt: skip
    core = EngineCore(Scheduler(config), executor, async_scheduling=async_scheduling)
    stops = SamplingParams(temperature=0.0, max_tokens=50)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core.add_request(Request("eos", [7, 8], stops, seed=1, eos_token_ids=frozenset({eos})))
    core.add_request(Request("len", [7, 9], short, seed=2, eos_token_ids=frozenset({eos})))
    core.add_request(Request("stop_id", [4], replace(stops, stop_token_ids=[11]), seed=3))
    updates = run_until_done(core)
    got = {u.request_id: [] for u in updates}
    for u in updates:
        got[u.request_id].extend(u.new_token_ids)
    finals = {u.request_id: (u.finish_reason, u.stop_reason) for u in updates if u.finished}
    assert got == {"eos": [10, 11, 12, eos], "len": [10, 11], "stop_id": [10, 11]}
    assert finals == {"eos": ("stop", None), "len": ("length", None), "stop_id": ("stop", 11)}
    ran_past = len(executor.sampled["eos"]) - len(got["eos"])
    # the step in flight when EOS came back computed one more token, never reported
    assert ran_past == (1 if async_scheduling else 0)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_with_a_step_in_flight_frees_everything(async_scheduling):
    config = CONFIGS["preempting"]
    requests = _requests(12, seed=4, greedy=True)
    requests = {r: (p, replace(s, max_tokens=40)) for r, (p, s) in requests.items()}
    core = build_engine_core(config, vocab_size=VOCAB, async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        core.add_request(Request(rid, prompt, params, seed=params.seq_seed))
    tokens: dict[str, list[int]] = {}
    finals = {}
    for step in range(400):
        if step == 6:
            core.abort(["r1", "r5"])
        if not core.has_unfinished_requests():
            break
        for u in core.step():
            assert u.request_id not in finals
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                finals[u.request_id] = u.finish_reason
    assert finals["r1"] == finals["r5"] == "abort"
    for rid, (prompt, params) in requests.items():
        full = reference_generate(prompt, params, params.seq_seed, VOCAB, params.max_tokens)
        assert tokens.get(rid, []) == full[: len(tokens.get(rid, []))]
    sched = core.scheduler
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert sched.state_slots.num_free_slots == sched.state_slots.num_usable_slots
