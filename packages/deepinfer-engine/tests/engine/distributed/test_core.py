"""DataParallelCore over in-process fake executors: the same tokens as one engine core, requests
spread by load, every rank stepped when expert parallelism needs matching collectives, and
with asynchronous scheduling the next step sent before the last one is collected."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.distributed.core import DataParallelCore, request_load
from deepinfer.engine.testing.fake_executor import (
    HashModelExecutor,
    LocalRanks,
    build_engine_core,
    run_until_done,
)
from deepinfer.sampling import SamplingParams

VOCAB = 97
CONFIG = SchedulerConfig(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=128,
    num_blocks=120,
    block_size=4,
    num_state_slots=17,
    compression_ratios=(1, 2, 4),
)


class HashRanks(LocalRanks):
    """Fake hash-model executors, one per rank (``fail_request_ids``: requests they fail)."""

    def __init__(self, world_size: int, fail_request_ids=()) -> None:
        super().__init__([
            HashModelExecutor(CONFIG.num_blocks, CONFIG.block_size, CONFIG.num_state_slots, VOCAB,
                              fail_request_ids=set(fail_request_ids))
            for _ in range(world_size)
        ])  # fmt: skip


class LaunchingRanks(HashRanks):
    """LocalRanks with ``launch``: steps run when collected, in the order they were sent."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.queue: list[_Sent] = []
        self.most_in_flight = 0

    def launch(self, outputs):
        self.steps.append(sorted(outputs))
        sent = _Sent(self, outputs)
        self.queue.append(sent)
        self.most_in_flight = max(self.most_in_flight, len(self.queue))
        return sent


class _Sent:
    def __init__(self, ranks: LaunchingRanks, outputs) -> None:
        self.ranks, self.outputs, self.results = ranks, outputs, None

    def result(self):
        while self.results is None:  # every step sent before this one runs first
            head = self.ranks.queue.pop(0)
            head.results = {
                r: self.ranks.executors[r].execute(so) for r, so in head.outputs.items()
            }
        return self.results


def _requests(num: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        greedy = i % 2 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 0.8,
            max_tokens=rng.randint(1, 8),
            ignore_eos=True,
            seq_seed=rng.randrange(1 << 40),
            n=1 if i % 5 else 2,
        )
        requests.append(Request(f"r{i}", prompt, params, seed=params.seq_seed))
    return requests


def _tokens(updates) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for u in updates:
        tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
    return tokens


def _core(world_size: int, every_rank_steps: bool = False, **kwargs):
    ranks = HashRanks(world_size, **kwargs)
    schedulers = [Scheduler(CONFIG) for _ in range(world_size)]
    return DataParallelCore(schedulers, ranks, every_rank_steps=every_rank_steps), ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_tokens_as_one_engine_core(world_size):
    single = build_engine_core(CONFIG, vocab_size=VOCAB)
    for request in _requests(30, seed=world_size):
        single.add_request(request)
    expected = _tokens(run_until_done(single))
    core, ranks = _core(world_size)
    placed = [core.add_request(r) for r in _requests(30, seed=world_size)]
    assert set(placed) == set(range(world_size))
    assert _tokens(run_until_done(core)) == expected
    assert not core.has_unfinished_requests() and core.rank_loads() == [0] * world_size


@pytest.mark.parametrize("every_rank_steps", [False, True])
def test_asynchronous_steps_give_the_synchronous_tokens(every_rank_steps):
    sync, _ = _core(2, every_rank_steps=every_rank_steps)
    ranks = LaunchingRanks(2)
    schedulers = [Scheduler(CONFIG) for _ in range(2)]
    ahead = DataParallelCore(
        schedulers, ranks, every_rank_steps=every_rank_steps, async_scheduling=True
    )
    for core in (sync, ahead):
        for request in _requests(30, seed=11):
            core.add_request(request)
    assert _tokens(run_until_done(ahead)) == _tokens(run_until_done(sync))
    assert ranks.most_in_flight == 2  # the next step went out before the last came back
    if every_rank_steps:
        assert all(step == [0, 1] for step in ranks.steps)
    assert not ahead.has_unfinished_requests() and ahead.rank_loads() == [0, 0]
    assert not DataParallelCore(schedulers, HashRanks(2), every_rank_steps=False,
                                async_scheduling=True).async_scheduling  # fmt: skip


def test_requests_go_to_the_rank_with_fewest_tokens_left():
    core, _ = _core(2)
    long, short = SamplingParams(max_tokens=100), SamplingParams(max_tokens=1)
    assert core.add_request(Request("a", [1] * 50, long, seed=1)) == 0  # 150 tokens
    assert core.add_request(Request("b", [1] * 10, short, seed=1)) == 1  # 11
    assert core.add_request(Request("c", [1] * 10, short, seed=1)) == 1  # 22
    assert core.rank_loads() == [150, 22]
    forked = Request("d", [1] * 4, SamplingParams(max_tokens=10, n=3), seed=1)
    assert request_load(forked) == 4 + 3 * 10


def test_idle_ranks_sit_out_without_ep_and_step_with_it():
    for every_rank_steps, reached in ((False, [0]), (True, [0, 1, 2])):
        core, ranks = _core(3, every_rank_steps=every_rank_steps)
        core.schedulers[0].add_request(
            Request("only", [3, 4, 5], SamplingParams(max_tokens=2), seed=7)
        )
        run_until_done(core)
        assert ranks.steps and all(step == reached for step in ranks.steps)


def test_a_failing_request_finishes_alone():
    core, _ = _core(2, fail_request_ids={"r3"})
    for request in _requests(8, seed=5):
        core.add_request(request)
    finals = {u.request_id: u for u in run_until_done(core) if u.finished}
    assert finals["r3"].finish_reason == "error"
    assert all(u.finish_reason == "length" for rid, u in finals.items() if rid != "r3")


def test_scheduler_count_must_match_the_ranks():
    with pytest.raises(ValueError, match="schedulers: expected one per rank"):
        DataParallelCore([Scheduler(CONFIG)], HashRanks(2), every_rank_steps=False)


def test_a_layout_the_model_cannot_split_is_refused_before_any_process(tmp_path):
    import json

    from deepinfer.engine.frontend.llm import LLM
    from deepinfer.engine.testing import tiny_v41_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_v41_config(vision=False)))
    with pytest.raises(ValueError, match="expected a divisor of the model's 4 routed experts"):
        LLM(str(tmp_path), accelerator="cpu", data_parallel_size=3, expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size=2: expected 1"):
        LLM(str(tmp_path), accelerator="cpu", data_parallel_size=4, expert_parallel_size=2)
