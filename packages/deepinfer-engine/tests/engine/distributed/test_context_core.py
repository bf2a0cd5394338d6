"""ContextParallelCore over in-process fake executors that run CP chunks by writing the chunk
into their simulated arena and ring (the fake model reads its context back from them): long
prompts give one engine core's tokens and prompt logprobs with one or two CP groups, with
asynchronous steps, and under expert parallelism (every rank reached by every step); a long
prompt waits until its group has room, one that never fits as a CP prefill runs on its owner,
an aborted one finishes alone, and every reservation is given back."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.distributed.context_core import ContextParallelCore
from deepinfer.engine.testing.fake_executor import (
    HashModelExecutor,
    LocalRanks,
    build_engine_core,
    run_until_done,
    token_logprob,
)
from deepinfer.sampling import SamplingParams

VOCAB = 97
CONFIG = SchedulerConfig(
    max_num_seqs=16,
    max_num_batched_tokens=16,
    max_model_len=160,
    num_blocks=120,
    block_size=4,
    num_state_slots=17,
    compression_ratios=(1, 2, 4),
)


class FakeContextExecutor(HashModelExecutor):
    """Runs a CP chunk as the real executor does, on the fake's arena and ring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: dict[str, list] = {}
        self.num_idle = 0

    def execute(self, so):
        chunk = so.context_prefill
        if chunk is not None and chunk.request_id is None:
            self.num_idle += 1
        elif chunk is not None:
            if chunk.is_first:
                self.states[chunk.state_slot] = self._empty_ring()
            for i, token in enumerate(chunk.token_ids[:-1]):
                p = chunk.start + i
                self.arena[chunk.block_ids[p // self.block_size]][p % self.block_size] = token
                self.states[chunk.state_slot][p % self.ring_size] = (p, token)
            if chunk.is_owner and chunk.prompt_logprobs is not None:
                self.kept.setdefault(chunk.request_id, []).extend(
                    {t: token_logprob(t, chunk.start + i + 1)}
                    for i, t in enumerate(chunk.token_ids[1:])
                )
        out = super().execute(replace(so, context_prefill=None))
        for new in so.new_requests:
            kept = self.kept.pop(new.request_id, None)
            if kept is not None and new.num_computed_tokens:
                out.prompt_logprobs[new.request_id] = kept + out.prompt_logprobs.get(
                    new.request_id, []
                )
        for request_id in so.finished_request_ids:
            self.kept.pop(request_id, None)
        return out


def _requests(num: int, seed: int, longest: int = 6) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        length = rng.choice([rng.randint(2, 20), rng.randint(40, 120)])
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            max_tokens=rng.randint(1, longest),
            ignore_eos=True,
            seq_seed=rng.randrange(1 << 40),
            n=1 if i % 5 else 2,
            prompt_logprobs=0 if i % 3 == 0 else None,
        )
        requests.append(Request(f"r{i}", prompt, params, seed=params.seq_seed))
    return requests


def _results(updates) -> dict[str, tuple]:
    tokens, prompt = {}, {}
    for u in updates:
        tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        if u.prompt_logprobs is not None:
            prompt[u.request_id] = u.prompt_logprobs
    return {rid: (tokens[rid], prompt.get(rid)) for rid in tokens}


def _core(world_size, cp, config=CONFIG, **options):
    schedulers = [Scheduler(config) for _ in range(world_size)]
    ranks = LocalRanks([
        FakeContextExecutor(config.num_blocks, config.block_size, config.num_state_slots, VOCAB)
        for _ in range(world_size)
    ])  # fmt: skip
    options.setdefault("every_rank_steps", False)
    core = ContextParallelCore(
        schedulers, ranks, context_parallel_size=cp, cp_min_tokens=40, **options
    )
    return core, ranks


def _all_free(core) -> bool:
    return all(
        s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks
        and s.state_slots.num_free_slots == s.config.num_state_slots - 1
        for s in core.schedulers
    )


@pytest.mark.parametrize(
    ("world_size", "cp", "every_rank_steps", "num_blocks"),
    # 50 blocks and longer outputs: ranks preempt requests, CP-prefilled ones among them, which
    # recompute on their owner alone
    [(2, 2, False, 120), (4, 2, False, 120), (4, 2, True, 120), (2, 2, False, 50)],
)
def test_long_prompts_give_one_engine_cores_outputs(world_size, cp, every_rank_steps, num_blocks):
    config = replace(CONFIG, num_blocks=num_blocks)
    longest = 6 if num_blocks > 100 else 30
    single = build_engine_core(config, vocab_size=VOCAB)
    for request in _requests(24, world_size, longest):
        single.add_request(request)
    expected = _results(run_until_done(single))
    core, ranks = _core(world_size, cp, config=config, every_rank_steps=every_rank_steps)
    for request in _requests(24, world_size, longest):
        core.add_request(request)
    assert _results(run_until_done(core)) == expected
    assert core.num_context_chunks > 10 and _all_free(core)
    if num_blocks < 100:
        assert sum(s.num_preemptions for s in core.schedulers) > 0
    if every_rank_steps:  # ranks whose group had no chunk ran idle MoE exchanges
        assert all(step == list(range(world_size)) for step in ranks.steps)
        assert any(e.num_idle for e in ranks.executors)


def test_a_long_prompt_waits_for_room_and_one_that_never_fits_fails_on_its_owner():
    config = replace(CONFIG, num_blocks=40)  # 39 usable blocks of 4 tokens
    core, _ = _core(2, 2, config=config)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    filler = Request("filler", [5] * 40, replace(params, max_tokens=60), seed=1)
    core.schedulers[1].add_request(filler)  # holds 4 to 25 of rank 1's blocks for a while
    assert core.add_request(Request("long", [7] * 150, params, seed=2)) == 0  # 38 blocks
    core.step()
    assert not core.jobs[0][0].started  # rank 1 cannot hold it yet
    finals = {u.request_id: u for u in run_until_done(core) if u.finished}
    assert finals["long"].finish_reason == "length" and core.num_context_chunks == 5
    assert _all_free(core)
    core, _ = _core(2, 2, config=replace(config, num_blocks=30))  # 29: never fits
    core.add_request(Request("long", [7] * 150, params, seed=2))
    finals = {u.request_id: u for u in run_until_done(core) if u.finished}
    assert finals["long"].finish_reason == "error" and "KV-cache blocks" in finals["long"].error
    assert core.num_context_chunks == 0 and _all_free(core)


def test_an_aborted_cp_request_finishes_alone_and_frees_its_reservation():
    core, ranks = _core(2, 2)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, prompt_logprobs=0)
    core.add_request(Request("long", [7] * 100, params, seed=1))
    core.add_request(Request("other", [4] * 10, params, seed=2))
    core.step()  # the first of 4 chunks
    assert core.jobs[0][0].started
    assert any("long" in e.kept for e in ranks.executors)  # the owner keeps its scores
    core.abort(["long"])
    finals = {u.request_id: u for u in run_until_done(core) if u.finished}
    assert finals["long"].finish_reason == "abort"
    assert finals["other"].finish_reason == "length" and _all_free(core)
    assert all(not e.kept for e in ranks.executors)  # told to forget them
