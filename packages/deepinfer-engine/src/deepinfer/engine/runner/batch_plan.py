"""The runner's side of the step boundary, torch-free: mirror the scheduler's diffs and lay
out one step as flat index lists (FlashAttention vocabulary) for the model and the sampler.

``RunnerState.apply(scheduler_output)`` keeps the executor's copy of every scheduled sequence
(tokens, block table, state slot, parameters). ``build_step_plan`` then lists, in scheduling
order, each request's input tokens and positions, its block table and state slot, and the
rows to sample: the last row of a request whose chunk reaches its last token (once per seed
for an ``n > 1`` fork), or, when drafts are verified, the rows of the last known token and
of every draft. A device runner turns the lists into tensors; nothing here touches one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.core.block_manager import NULL_BLOCK_ID
from deepinfer.engine.core.scheduler_output import SchedulerOutput


@dataclass
class RunnerSequence:
    """The executor's copy of one sequence."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: Any
    seed: int
    block_ids: list[int]
    state_slot: int
    num_computed_tokens: int
    has_user_seed: bool = True
    images: tuple[Any, ...] = ()  # V4.1 images of the prompt (frontend ImageInput)
    # the sampling parameters of a row drawn with a given seed (built once, not every step)
    row_params: dict[int, Any] = field(default_factory=dict)
    draft_params: Any = None  # those its drafts are picked with (built once, by the runner)


@dataclass
class RunnerState:
    """Every sequence the executor holds, updated from ``SchedulerOutput`` diffs.

    last_sampled: per request, the newest token the executor sampled for it (the executor
    records it each step); a ``from_previous_sample`` request gets it appended (token 0 when
    there is none: the scheduler fails that request and drops what this step computes).
    """

    sequences: dict[str, RunnerSequence] = field(default_factory=dict)
    last_sampled: dict[str, int] = field(default_factory=dict)

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Drop finished / preempted ids, register new ones, apply cached diffs.

        Block and state copies are tensor work: the runner performs
        ``scheduler_output.block_copies`` / ``state_copies`` itself, before the forward.
        """
        so = scheduler_output
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.sequences.pop(request_id, None)
            self.last_sampled.pop(request_id, None)
        for new in so.new_requests:
            self.sequences[new.request_id] = RunnerSequence(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                seed=new.seed,
                block_ids=list(new.block_ids),
                state_slot=new.state_slot,
                num_computed_tokens=new.num_computed_tokens,
                has_user_seed=new.has_user_seed,
                images=new.images,
            )
        for cached in so.cached_requests:
            seq = self.sequences[cached.request_id]
            seq.token_ids.extend(cached.new_token_ids)
            if cached.request_id in so.from_previous_sample:
                # none when the previous step failed the request: this step's result is dropped
                seq.token_ids.append(self.last_sampled.get(cached.request_id, 0))
            seq.block_ids.extend(cached.new_block_ids)
            for index, block_id in cached.replaced_block_ids:
                seq.block_ids[index] = block_id
            seq.num_computed_tokens = cached.num_computed_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as flat lists.

    Per request ``b`` (scheduling order): ``request_ids[b]``; tokens ``input_ids[t]`` at
    ``positions[t]`` for ``t`` in ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``; ``seq_lens[b]`` the
    context length after the step; ``block_tables[b]`` padded with the null block 0 to the
    longest table; ``state_slots[b]``; ``is_fresh[b]`` when the sequence starts from position
    0 (its state slot holds nothing of it); ``num_drafts[b]`` drafts verified.

    Sampling rows ``s``: the token at row ``sample_rows[s]`` predicts position
    ``sample_positions[s]`` of request ``sample_requests[s]`` (an index ``b``), drawn with
    ``sample_seeds[s]``. A request's rows are consecutive: one row, or ``n`` copies of its last
    row for a fork (one seed each), or ``1 + num_drafts[b]`` rows for verification.

    Prompt logprobs: ``prompt_logprob_rows[s]`` predicts prompt token
    ``prompt_logprob_targets[s]`` of request ``prompt_logprob_requests[s]``.
    """

    request_ids: list[str]
    input_ids: list[int]
    positions: list[int]
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    state_slots: list[int]
    is_fresh: list[bool]
    num_drafts: list[int]
    sample_rows: list[int]
    sample_positions: list[int]
    sample_requests: list[int]
    sample_seeds: list[int]
    prompt_logprob_rows: list[int]
    prompt_logprob_targets: list[int]
    prompt_logprob_requests: list[int]
    images: list[tuple[int, Any]]  # (row of the span's first token, image) per span this step

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def logits_layout(self) -> tuple[list[int], list[int], list[int]]:
        """(``logits_indices``: the distinct rows that need logits, ascending; for each sampling
        row, its index in them; for each prompt-logprob row, its index in them)."""
        rows = sorted(set(self.sample_rows) | set(self.prompt_logprob_rows))
        where = {row: i for i, row in enumerate(rows)}
        return (
            rows,
            [where[r] for r in self.sample_rows],
            [where[r] for r in self.prompt_logprob_rows],
        )

    def sample_params(self, state: RunnerState) -> list[Any]:
        """The sampling parameters of every sampling row."""
        return [state.sequences[self.request_ids[b]].sampling_params for b in self.sample_requests]


def build_step_plan(state: RunnerState, scheduler_output: SchedulerOutput) -> StepPlan:
    """Lay out ``scheduler_output`` (already applied to ``state``) as a :class:`StepPlan`."""
    so, sequences = scheduler_output, state.sequences
    lists: dict[str, list] = {name: [] for name in StepPlan.__slots__}
    # the hot loop of a large batch: bound methods, the usual one-row sample inline
    input_ids, positions = lists["input_ids"].extend, lists["positions"].extend
    seq_lens, tables, slots = lists["seq_lens"].append, lists["block_tables"], lists["state_slots"]
    is_fresh, num_drafts = lists["is_fresh"].append, lists["num_drafts"].append
    sample_rows, sample_positions = lists["sample_rows"], lists["sample_positions"]
    sample_seeds, sample_requests = lists["sample_seeds"], lists["sample_requests"]
    spec, forks = so.scheduled_spec_token_ids, so.fork_seeds
    row = 0
    for b, (request_id, num_new) in enumerate(so.num_scheduled_tokens.items()):
        seq = sequences[request_id]
        drafts = spec.get(request_id, ()) if spec else ()
        known = len(seq.token_ids)  # then the drafts (not copied with the whole sequence)
        start = seq.num_computed_tokens
        end = start + num_new
        input_ids(seq.token_ids[start:end])
        if end > known:
            input_ids(drafts[max(start - known, 0) : end - known])
        positions(range(start, end))
        seq_lens(end)
        tables.append(seq.block_ids)  # (copied when padded)
        slots.append(seq.state_slot)
        is_fresh(start == 0)
        num_drafts(len(drafts))
        if seq.images:
            _add_images(lists, row, seq, start, end)
        if getattr(seq.sampling_params, "prompt_logprobs", None) is not None:
            _add_prompt_logprobs(lists, b, row, seq, start, end)
        row += num_new
        if end < known + len(drafts):
            continue  # a prefill chunk that does not reach the end samples nothing
        if drafts or (forks and request_id in forks):
            _add_samples(lists, b, row - 1, end, seq.seed, drafts, forks.get(request_id))
        else:  # one row: the last token's
            sample_rows.append(row - 1)
            sample_positions.append(end)
            sample_seeds.append(seq.seed)
            sample_requests.append(b)
    lists["request_ids"] = list(so.num_scheduled_tokens)
    lists["cu_seqlens_q"] = [0, *itertools.accumulate(so.num_scheduled_tokens.values())]
    width = max(map(len, tables), default=0)
    lists["block_tables"] = [t + [NULL_BLOCK_ID] * (width - len(t)) for t in tables]
    return StepPlan(**lists)


def _add_images(lists, first_row: int, seq: RunnerSequence, start: int, end: int) -> None:
    for image in seq.images:  # a span lies whole in one chunk (the scheduler's cut)
        if start <= image.offset < end:
            lists["images"].append((first_row + image.offset - start, image))


def _add_prompt_logprobs(lists, b, first_row: int, seq: RunnerSequence, start, end) -> None:
    # row of position q predicts token q + 1: this step covers prompt tokens start+1 .. end
    for position in range(start + 1, min(end + 1, seq.num_prompt_tokens)):
        lists["prompt_logprob_rows"].append(first_row + position - 1 - start)
        lists["prompt_logprob_targets"].append(seq.token_ids[position])
        lists["prompt_logprob_requests"].append(b)


def _add_samples(lists, b, last_row: int, end: int, seed: int, drafts, seeds) -> None:
    if seeds:
        count = len(seeds)
        lists["sample_rows"].extend([last_row] * count)
        lists["sample_positions"].extend([end] * count)
        lists["sample_seeds"].extend(seeds)
    else:  # the last known token's row and each draft's
        count = len(drafts) + 1
        lists["sample_rows"].extend(range(last_row - len(drafts), last_row + 1))
        lists["sample_positions"].extend(range(end - len(drafts), end + 1))
        lists["sample_seeds"].extend([seed] * count)
    lists["sample_requests"].extend([b] * count)
