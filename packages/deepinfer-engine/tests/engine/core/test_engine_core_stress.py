"""Randomised runs: random limits, n, drafts, aborts and failures, synchronous and
asynchronous scheduling; outputs stay exact."""

import random

import pytest

from deepinfer.engine.core import Request, SchedulerConfig
from deepinfer.engine.core.request import child_seed
from deepinfer.engine.testing.fake_executor import build_engine_core, reference_generate
from deepinfer.sampling import SamplingParams

VOCAB = 61


def _random_config(rng: random.Random) -> tuple[SchedulerConfig, int]:
    block_size = rng.choice([2, 4, 8])
    drafts = rng.choice([0, 0, 2, 3])
    config = SchedulerConfig(
        max_num_seqs=rng.randint(2, 12),
        max_num_batched_tokens=rng.randint(4, 48),
        max_model_len=96,
        num_blocks=rng.randint(96 // block_size + 2, 160 // block_size + 20),
        block_size=block_size,
        num_state_slots=13,
        compression_ratios=(1, 2),
        num_lookahead_tokens=drafts,
    )
    return config, drafts


@pytest.mark.parametrize("trial", range(16))
def test_random_runs_are_exact_and_leak_nothing(trial):
    rng = random.Random(trial)
    config, drafts = _random_config(rng)
    failing = {f"r{i}" for i in range(20) if rng.random() < 0.1}
    core = build_engine_core(
        config,
        vocab_size=VOCAB,
        num_draft_tokens=drafts,
        fail_request_ids=failing,
        async_scheduling=trial % 2 == 1,
    )
    requests = {}
    for i in range(20):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 50))]
        n = rng.choice([1, 1, 1, 2, 3]) if i % 3 else 1
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            n=min(n, config.max_num_seqs),
            max_tokens=rng.randint(1, 30),
            ignore_eos=True,
            seq_seed=rng.randrange(1 << 30),
        )
        requests[f"r{i}"] = (prompt, params)
        core.add_request(Request(f"r{i}", prompt, params, seed=params.seq_seed))
    to_abort = {rid for rid in requests if rng.random() < 0.15}
    tokens: dict[tuple[str, int], list[int]] = {}
    finals = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        if step == 5:
            core.abort(to_abort)
        for u in core.step():
            tokens.setdefault((u.group_id, u.index), []).extend(u.new_token_ids)
            if u.finished:
                finals[(u.group_id, u.index)] = u.finish_reason
    for rid, (prompt, params) in requests.items():
        for k in range(params.n):
            reason = finals.get((rid, k))
            got = tokens.get((rid, k), [])
            seed = child_seed(params.seq_seed, k)
            full = reference_generate(prompt, params, seed, VOCAB, params.max_tokens)
            if rid in failing:
                assert reason == "error" or (reason == "abort" and rid in to_abort)
            elif reason == "length":
                limit = min(params.max_tokens, config.max_model_len - len(prompt))
                assert got == full[:limit] and len(got) == limit
            else:
                assert reason == "abort" and rid in to_abort, (rid, k, reason)
                assert got == full[: len(got)]
    sched = core.scheduler
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert sched.state_slots.num_free_slots == sched.state_slots.num_usable_slots
    assert not sched.running and not sched.waiting and not sched.requests
