"""The plain data crossing the scheduler / executor boundary (diffs only, no tensors).

One step: ``Scheduler.schedule() -> SchedulerOutput``; ``Executor.execute(SchedulerOutput)
-> ModelRunnerOutput``; ``Scheduler.update(SchedulerOutput, ModelRunnerOutput)``.

The executor keeps its own copy of each scheduled sequence (tokens, block table, state slot)
and updates it from these diffs. Before the forward it performs ``block_copies`` and
``state_copies`` (whole block / whole state slot, source to destination) and forgets the ids in
``finished_request_ids`` and ``preempted_request_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A sequence the executor has not seen, or sees again after preemption or a fork.

    token_ids: every token known (prompt, then generated tokens of a resumed or forked one).
    num_prompt_tokens: how many of ``token_ids`` are the user's prompt (prompt logprobs).
    num_computed_tokens: positions already in the cache (0, or the prompt length of a fork
        child, whose blocks are shared and whose state slot is copied this step).
    block_ids: the block table; state_slot: the state slot id.
    seed: the sequence's sampling seed (a fork child's differs from its parent's).
    has_user_seed: whether the user chose the seed (else the engine drew it).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    sampling_params: Any
    seed: int
    block_ids: list[int]
    state_slot: int
    has_user_seed: bool = True
    images: tuple[Any, ...] = ()  # V4.1 images of the prompt (spans, patches), passed through


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A sequence the executor already holds.

    new_token_ids: tokens appended since the executor last saw it (last step's samples).
    new_block_ids: blocks appended to its table.
    replaced_block_ids: ``(table index, new block id)`` pairs; the old block's contents are
        copied to the new one by a ``block_copies`` entry of the same step (copy on write).
    num_computed_tokens: positions already in the cache before this step.
    """

    request_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    replaced_block_ids: list[tuple[int, int]]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class ContextPrefill:
    """This rank's part in one chunk of a context-parallel prefill, run before the step's own
    work by every rank of the owner's CP group (``request_id`` None: the rank's group has no
    chunk this step, but under expert parallelism it still takes part in the MoE exchanges).

    token_ids: the prompt at positions ``start ..``; the chunk computes all but the last, which
        is only the target of the last row's prompt logprob.
    block_ids / state_slot: where this rank writes the chunk (its own reservation).
    is_first: the prompt's first chunk (the state slot starts clean).
    prompt_logprobs: the request's top-k of prompt logprobs (None: not asked).
    is_owner: this rank decodes the request: it keeps the chunk's prompt logprobs and reports
        them with the request's first own step (``NewRequestData`` with computed tokens).
    """

    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    start: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = 0
    is_first: bool = False
    prompt_logprobs: int | None = None
    is_owner: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to run this step.

    num_scheduled_tokens: per request id, positions to compute this step, starting at its
        ``num_computed_tokens`` (a prefill chunk, 1 for a decode, 1 + drafts for verification).
        A request samples when the chunk reaches its last known token.
    scheduled_spec_token_ids: draft tokens appended to the scheduled input (verification).
    fork_seeds: requests whose prompt ends this step and fork into ``n`` samples: the last
        row is sampled once per seed, in sample order, giving the first token of each sample.
    from_previous_sample: requests whose input ends with the token the executor sampled for
        them in its previous step, which the scheduler does not know yet (asynchronous
        scheduling): the executor appends that token to its copy itself, after this step's
        ``new_token_ids``; ``num_computed_tokens`` counts the position of the token before it.
    context_prefill: this rank's part in a context-parallel prefill chunk (run first).
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    fork_seeds: dict[str, list[int]] = field(default_factory=dict)
    from_previous_sample: set[str] = field(default_factory=set)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    context_prefill: ContextPrefill | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to tell the executor."""
        return not (
            self.num_scheduled_tokens
            or self.finished_request_ids
            or self.preempted_request_ids
            or self.state_copies
            or self.context_prefill is not None
        )


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """One request's verification in one step.

    num_draft_tokens: drafts the target verified (may be fewer than scheduled under
        confidence-scheduled verification); num_accepted_tokens: how many of them were
        accepted (the step emits these plus one final token); draft_confidences: the
        drafter's confidence of each verified draft, when the engine was asked for them.
    """

    num_draft_tokens: int
    num_accepted_tokens: int
    draft_confidences: list[float] | None = None


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Results of one step, per request id (plain Python values).

    sampled_token_ids: tokens to append (empty or absent for a prefill chunk that does not
        reach the end; 1 for a decode; accepted drafts + 1 for verification; one per sample,
        in sample order, for a ``fork_seeds`` request).
    logprobs: per sampled token, ``{token id: logprob}`` for the sampled token and the top-k
        alternatives (only for requests whose parameters ask for logprobs).
    prompt_logprobs: per prompt token ``i >= 1`` whose predicting row (position ``i - 1``)
        was computed this step, in order, the same kind of dict for token ``i`` (only when
        asked).
    errors: requests that failed this step (a grammar that will not compile, say), with the
        message; each fails alone with finish reason ``"error"``.
    draft_token_ids: draft tokens proposed for the next step (speculative decoding); the
        scheduler verifies them next step as ``scheduled_spec_token_ids``.
    spec_stats: per request that verified drafts this step, what was verified and accepted.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_stats: dict[str, SpecDecodeStats] = field(default_factory=dict)


@dataclass(slots=True)
class SequenceUpdate:
    """What one step changed in one sequence, as ``Scheduler.update`` reports it.

    Not frozen, unlike the types above: it is built per sequence per step and stays in the
    front end's process (scheduler to output processor), where a frozen init's cost shows.

    new_text: text appended this step; text_length: the length of the whole output text after
        this step. A stop string can cut text reported earlier: the text is then
        ``(previous text + new_text)[:text_length]``.
    prompt_logprobs: on the finishing update of sample 0, the prompt logprobs gathered.
    num_verify_steps / num_draft_tokens / num_accepted_tokens / draft_confidences: this
        step's speculative verification (0 / None without one). Accepted drafts are counted
        as emitted: when a stop ends the sequence inside the accepted run, the last emitted
        token counts as the step's final token, so emitted = accepted + verify steps.
    """

    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    new_text: str = ""
    text_length: int = 0
    prompt_logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_confidences: list[float] | None = None
