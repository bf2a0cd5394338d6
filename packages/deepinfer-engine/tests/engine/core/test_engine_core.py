"""EngineCore over the fake hash model: exactness under batching, chunking, preemption, forks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deepinfer.engine.core import Request, SchedulerConfig
from deepinfer.engine.core.request import child_seed
from deepinfer.engine.testing.fake_executor import (
    build_engine_core,
    reference_generate,
    run_until_done,
)
from deepinfer.sampling import SamplingParams

VOCAB = 97


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(num)]


def _params(rng: random.Random, max_tokens: int, greedy: bool) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if greedy else 0.8,
        max_tokens=max_tokens,
        ignore_eos=True,
        seq_seed=rng.randrange(1 << 40),
    )


def _run(config: SchedulerConfig, prompts, params, **kwargs) -> dict[str, list[list[int]]]:
    """Generate for all requests; tokens per request id, per sample index."""
    core = build_engine_core(config, vocab_size=VOCAB, **kwargs)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"r{i}", prompt, p, seed=p.seq_seed))
    tokens: dict[str, list[list[int]]] = {}
    for update in run_until_done(core):
        per_sample = tokens.setdefault(update.group_id, [[] for _ in range(8)])
        per_sample[update.index].extend(update.new_token_ids)
    sched = core.scheduler
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert sched.state_slots.num_free_slots == sched.state_slots.num_usable_slots
    return {rid: [s for s in samples if s] for rid, samples in tokens.items()}


def _expected(prompts, params) -> dict[str, list[list[int]]]:
    return {
        f"r{i}": [reference_generate(prompt, p, p.seq_seed, VOCAB, p.max_tokens)]
        for i, (prompt, p) in enumerate(zip(prompts, params))
    }


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
    "few_seqs": SchedulerConfig(
        max_num_seqs=3, max_num_batched_tokens=20, max_model_len=128, num_blocks=60,
        block_size=8, num_state_slots=4, compression_ratios=(1, 2, 4),
    ),
}  # fmt: skip


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_batched_outputs_equal_the_plain_loop(config_name, greedy):
    rng = random.Random(7)
    prompts = _prompts(50, seed=3)
    params = [_params(rng, rng.randint(1, 24), greedy) for _ in prompts]
    got = _run(CONFIGS[config_name], prompts, params)
    assert got == _expected(prompts, params)


def test_each_request_alone_equals_all_together():
    rng = random.Random(11)
    prompts = _prompts(12, seed=5)
    params = [_params(rng, 10, greedy=False) for _ in prompts]
    together = _run(CONFIGS["preempting"], prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = _run(CONFIGS["roomy"], [prompt], [p])
        assert alone["r0"] == together[f"r{i}"]


def test_preemption_happens_and_is_recomputed_exactly():
    rng = random.Random(2)
    prompts = _prompts(20, seed=9)
    params = [_params(rng, 30, greedy=True) for _ in prompts]
    core = build_engine_core(CONFIGS["preempting"], vocab_size=VOCAB)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"r{i}", prompt, p, seed=p.seq_seed))
    run_until_done(core)
    assert core.scheduler.num_preemptions > 0
    assert _run(CONFIGS["preempting"], prompts, params) == _expected(prompts, params)


@pytest.mark.parametrize("config_name", ["roomy", "chunked", "preempting"])
def test_n_samples_share_the_prompt_and_follow_their_own_seeds(config_name):
    rng = random.Random(4)
    prompts = _prompts(6, seed=21)
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seq_seed=rng.randrange(1 << 30)
        )
        for _ in prompts
    ]
    got = _run(CONFIGS[config_name], prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        expected = [
            reference_generate(prompt, p, child_seed(p.seq_seed, k), VOCAB, 12) for k in range(3)
        ]
        assert got[f"r{i}"] == expected
        assert len({tuple(s) for s in expected}) > 1  # the samples really differ


def test_prompt_is_computed_once_for_n_samples():
    p = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=4, seq_seed=5)
    prompt = list(range(1, 31))
    core = build_engine_core(CONFIGS["roomy"], vocab_size=VOCAB)
    core.add_request(Request("r0", prompt, p, seed=5))
    computed = 0
    while core.has_unfinished_requests():
        output = core.scheduler.schedule()
        computed += output.total_num_scheduled_tokens
        core.scheduler.update(output, core.executor.execute(output))
    # 30 prompt positions once, then 4 samples x 2 more decode positions each
    assert computed == len(prompt) + 4 * 2


def test_a_failing_request_finishes_alone_with_error():
    rng = random.Random(8)
    prompts = _prompts(5, seed=1)
    params = [_params(rng, 6, greedy=True) for _ in prompts]
    core = build_engine_core(CONFIGS["roomy"], vocab_size=VOCAB, fail_request_ids={"r2"})
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"r{i}", prompt, p, seed=p.seq_seed))
    updates = run_until_done(core)
    finals = {u.group_id: u for u in updates if u.finished}
    assert finals["r2"].finish_reason == "error"
    assert "simulated failure" in finals["r2"].error
    expected = _expected(prompts, params)
    for i in (0, 1, 3, 4):
        assert finals[f"r{i}"].finish_reason == "length"
        tokens = [t for u in updates if u.group_id == f"r{i}" for t in u.new_token_ids]
        assert tokens == expected[f"r{i}"][0]


def test_abort_finishes_the_request_and_frees_its_resources():
    rng = random.Random(3)
    prompts = _prompts(4, seed=2)
    params = [_params(rng, 50, greedy=True) for _ in prompts]
    core = build_engine_core(CONFIGS["roomy"], vocab_size=VOCAB)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"r{i}", prompt, p, seed=p.seq_seed))
    for _ in range(3):
        core.step()
    core.abort(["r1"])
    updates = run_until_done(core)
    aborted = [u for u in updates if u.group_id == "r1"]
    assert [u.finish_reason for u in aborted] == ["abort"]
    assert sum(1 for u in updates if u.finished) == 4
    assert core.scheduler.block_manager.num_free_blocks == 199


def test_request_that_can_never_fit_fails_alone():
    config = CONFIGS["preempting"]  # 23 usable blocks of 4 tokens = 92 tokens
    big = list(range(1, 96))
    small = [5, 6, 7]
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, seq_seed=1)
    core = build_engine_core(config, vocab_size=VOCAB)
    core.add_request(Request("big", [t % VOCAB for t in big], p, seed=1))
    core.add_request(Request("small", small, p, seed=1))
    finals = {u.group_id: u for u in run_until_done(core) if u.finished}
    assert finals["big"].finish_reason == "error"
    assert "needs 24 KV-cache blocks" in finals["big"].error
    assert finals["small"].finish_reason == "length"


@pytest.mark.parametrize("config_name", ["roomy", "chunked", "preempting"])
@pytest.mark.parametrize("greedy", [True, False])
def test_draft_verification_gives_the_same_tokens(config_name, greedy):
    rng = random.Random(12)
    prompts = _prompts(16, seed=13)
    params = [_params(rng, rng.randint(1, 20), greedy) for _ in prompts]
    config = replace(CONFIGS[config_name], num_lookahead_tokens=3)
    got = _run(config, prompts, params, num_draft_tokens=3)
    assert got == _expected(prompts, params)


def test_drafts_are_both_accepted_and_rejected():
    rng = random.Random(1)
    prompts = _prompts(8, seed=2)
    params = [_params(rng, 16, greedy=True) for _ in prompts]
    core = build_engine_core(CONFIGS["roomy"], vocab_size=VOCAB, num_draft_tokens=3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"r{i}", prompt, p, seed=p.seq_seed))
    run_until_done(core)
    assert core.executor.num_accepted_drafts > 10 and core.executor.num_rejected_drafts > 10
    # fewer steps than tokens: accepted drafts advance several positions per step
    assert core.num_steps < 16
