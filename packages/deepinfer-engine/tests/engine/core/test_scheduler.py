"""Scheduling decisions on synthetic requests (no model)."""

import pytest

from deepinfer.engine.core import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from deepinfer.engine.core.scheduler_output import CachedRequestData, NewRequestData
from deepinfer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def _config(**overrides) -> SchedulerConfig:
    values = dict(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=256,
        num_blocks=33,
        block_size=4,
        num_state_slots=9,
        compression_ratios=(1, 2, 4),
    )
    values.update(overrides)
    return SchedulerConfig(**values)


def _add(sched: Scheduler, rid: str, num_tokens: int, params=GREEDY) -> Request:
    seed = params.seq_seed if params.seq_seed is not None else 1
    req = Request(rid, list(range(10, 10 + num_tokens)), params, seed=seed)
    sched.add_request(req)
    return req


def _sample_all(sched, output, token=3) -> ModelRunnerOutput:
    """Runner output sampling ``token`` for every request whose chunk reaches its end (the
    scheduler counts the step as computed and waits for its sample)."""
    sampled = {}
    for rid in output.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_placeholders or req.awaits_result:
            sampled[rid] = [token] * len(output.fork_seeds.get(rid, [0]))
    return ModelRunnerOutput(sampled_token_ids=sampled)


def test_chunked_prefill_and_decodes_share_the_budget_fcfs():
    sched = Scheduler(_config(max_num_batched_tokens=10))
    _add(sched, "a", 6)
    _add(sched, "b", 9)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}  # b's prompt is chunked
    sched.update(out, _sample_all(sched, out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}  # a decodes while b finishes its prompt
    assert [type(d) for d in out.cached_requests] == [CachedRequestData] * 2
    assert out.cached_requests[0].new_token_ids == [3]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = Scheduler(
        _config(max_num_batched_tokens=300, enable_chunked_prefill=False, num_blocks=200)
    )
    _add(sched, "a", 200)
    _add(sched, "b", 150)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 200}  # b would not fit whole in the budget left
    sched.update(out, _sample_all(sched, out))
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 150}
    with pytest.raises(ValueError, match="without chunked prefill"):
        _config(max_num_batched_tokens=100, enable_chunked_prefill=False)


def test_max_num_seqs_and_state_slots_bound_admission():
    sched = Scheduler(_config(max_num_seqs=2, num_state_slots=3))
    for rid in "abc":
        _add(sched, rid, 2)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert sorted(d.state_slot for d in out.new_requests) == [1, 2]


def test_blocks_are_allocated_as_tokens_grow_and_sent_as_diffs():
    sched = Scheduler(_config())
    _add(sched, "a", 7)
    out = sched.schedule()
    (new,) = out.new_requests
    assert isinstance(new, NewRequestData) and len(new.block_ids) == 2
    sched.update(out, _sample_all(sched, out))  # 8 tokens, 7 computed
    out = sched.schedule()  # computes position 7: still block 1
    assert out.cached_requests[0].new_block_ids == []
    sched.update(out, _sample_all(sched, out))
    out = sched.schedule()  # position 8 needs a third block
    assert len(out.cached_requests[0].new_block_ids) == 1


def test_preemption_frees_the_latest_request_and_requeues_it_first():
    # 6 usable blocks of 4 tokens
    sched = Scheduler(_config(num_blocks=7, max_num_batched_tokens=64))
    a = _add(sched, "a", 8)
    b = _add(sched, "b", 8)
    c = _add(sched, "c", 8)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
    assert sched.block_manager.num_free_blocks == 0
    sched.update(out, _sample_all(sched, out))  # each has 9 tokens: a needs a third block
    out = sched.schedule()
    assert out.preempted_request_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and not c.block_ids
    assert list(sched.waiting) == [c]
    # the scheduled step counts as computed, its token is a placeholder until the update
    assert a.num_computed_tokens == 9 and b.num_computed_tokens == 9
    assert a.num_placeholders == 1 and a.num_tokens == 9


def test_spec_tokens_are_scheduled_and_rejected_ones_uncomputed():
    sched = Scheduler(_config(num_lookahead_tokens=3))
    req = _add(sched, "a", 5)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({"a": [3]}, draft_token_ids={"a": [7, 8, 9]}))
    assert req.spec_token_ids == [7, 8, 9]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_token_ids == {"a": [7, 8, 9]}
    # one draft accepted (7) plus the corrected token 4
    sched.update(out, ModelRunnerOutput(sampled_token_ids={"a": [7, 4]}))
    assert req.output_token_ids == [3, 7, 4]
    assert req.num_computed_tokens == req.num_tokens - 1


def test_fork_shares_blocks_and_copies_on_first_write():
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seq_seed=9)
    sched = Scheduler(_config())
    parent = _add(sched, "g", 6, params)
    out = sched.schedule()
    assert len(out.fork_seeds["g"]) == 3 and out.fork_seeds["g"][0] == 9
    assert sched.state_slots.num_free_slots == 8 - 3
    prompt_blocks = list(parent.block_ids)
    updates = sched.update(out, ModelRunnerOutput(sampled_token_ids={"g": [4, 5, 6]}))
    assert [(u.request_id, u.new_token_ids) for u in updates] == [
        ("g", [4]),
        ("g#1", [5]),
        ("g#2", [6]),
    ]
    assert [sched.block_manager.ref_count(b) for b in prompt_blocks] == [3, 3]
    out = sched.schedule()
    assert len(out.state_copies) == 2 and all(
        src == parent.state_slot for src, _ in out.state_copies
    )
    # position 6 lies in the shared second block: the first two writers take private copies,
    # the last one (then its only holder) writes into the original
    assert len(out.block_copies) == 2
    assert {src for src, _ in out.block_copies} == {prompt_blocks[1]}
    assert sched.block_manager.ref_count(prompt_blocks[0]) == 3
    assert sched.block_manager.ref_count(prompt_blocks[1]) == 1
    assert sched.requests["g#2"].block_ids == prompt_blocks
    children = [d for d in out.new_requests]
    assert [d.request_id for d in children] == ["g#1", "g#2"]
    assert all(d.num_computed_tokens == 6 for d in children)


def test_drafts_are_trimmed_to_max_model_len():
    sched = Scheduler(_config(max_model_len=8))
    req = _add(sched, "a", 5)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({"a": [3]}, draft_token_ids={"a": [7, 8, 9]}))
    assert req.spec_token_ids == [7, 8]  # positions 5..7 are the last ones under 8
