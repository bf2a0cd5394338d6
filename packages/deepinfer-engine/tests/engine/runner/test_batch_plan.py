"""Step layout from scheduler diffs: rows, positions, tables and sampling rows."""

from deepinfer.engine.core import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from deepinfer.engine.runner.batch_plan import RunnerState, build_step_plan
from deepinfer.sampling import SamplingParams


def _config(**kw):
    base = dict(
        max_num_seqs=8,
        max_num_batched_tokens=9,
        max_model_len=64,
        num_blocks=40,
        block_size=4,
        num_state_slots=9,
        compression_ratios=(1, 2, 4),
    )
    return SchedulerConfig(**{**base, **kw})


def test_chunk_decode_and_prompt_logprob_rows():
    sched = Scheduler(_config())
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, seq_seed=11)
    logp = SamplingParams(max_tokens=9, ignore_eos=True, prompt_logprobs=0, seq_seed=12)
    sched.add_request(Request("a", [10, 11, 12], greedy, seed=11))
    sched.add_request(Request("b", [20, 21, 22, 23, 24, 25, 26, 27], logp, seed=12))
    state = RunnerState()
    out = sched.schedule()
    state.apply(out)
    plan = build_step_plan(state, out)
    assert plan.request_ids == ["a", "b"]
    assert plan.input_ids == [10, 11, 12, 20, 21, 22, 23, 24, 25]
    assert plan.positions == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert plan.cu_seqlens_q == [0, 3, 9] and plan.seq_lens == [3, 6]
    assert plan.is_fresh == [True, True]
    assert len(plan.block_tables[0]) == len(plan.block_tables[1]) == 2  # padded with block 0
    assert plan.block_tables[0][1] == 0
    assert plan.sample_rows == [2] and plan.sample_positions == [3] and plan.sample_seeds == [11]
    # rows 3..8 (positions 0..5 of b) predict prompt tokens 1..6
    assert plan.prompt_logprob_rows == [3, 4, 5, 6, 7, 8]
    assert plan.prompt_logprob_targets == [21, 22, 23, 24, 25, 26]
    sched.update(out, ModelRunnerOutput({"a": [13]}, draft_token_ids={"a": [14, 15]}))
    out = sched.schedule()
    state.apply(out)
    plan = build_step_plan(state, out)
    # a verifies [13, 14, 15] at positions 3..5; b finishes its prompt (positions 6, 7)
    assert plan.input_ids == [13, 14, 15, 26, 27]
    assert plan.num_drafts == [2, 0] and plan.is_fresh == [False, False]
    assert plan.sample_rows == [0, 1, 2, 4] and plan.sample_positions == [4, 5, 6, 8]
    assert plan.sample_requests == [0, 0, 0, 1]
    assert plan.prompt_logprob_rows == [3] and plan.prompt_logprob_targets == [27]
    rows, sample_at, prompt_at = plan.logits_layout()
    assert rows == [0, 1, 2, 3, 4] and sample_at == [0, 1, 2, 4] and prompt_at == [3]


def test_fork_samples_the_last_row_once_per_seed():
    sched = Scheduler(_config())
    p = SamplingParams(temperature=1.0, n=3, max_tokens=4, ignore_eos=True, seq_seed=5)
    sched.add_request(Request("g", [1, 2, 3, 4, 5], p, seed=5))
    state = RunnerState()
    out = sched.schedule()
    state.apply(out)
    plan = build_step_plan(state, out)
    assert plan.sample_rows == [4, 4, 4] and plan.sample_positions == [5, 5, 5]
    assert plan.sample_seeds == out.fork_seeds["g"] and plan.sample_seeds[0] == 5
    sched.update(out, ModelRunnerOutput({"g": [7, 8, 9]}))
    out = sched.schedule()
    state.apply(out)
    plan = build_step_plan(state, out)
    assert plan.request_ids == ["g", "g#1", "g#2"]
    assert plan.input_ids == [7, 8, 9] and plan.positions == [5, 5, 5]
    assert len(set(plan.state_slots)) == 3 and out.state_copies
    assert [state.sequences[r].token_ids[-1] for r in plan.request_ids] == [7, 8, 9]
