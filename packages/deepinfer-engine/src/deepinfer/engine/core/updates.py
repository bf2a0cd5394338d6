"""How a step's sampled tokens change a sequence: append, stop checks, fork of ``n > 1``, and
the bookkeeping of steps in flight (asynchronous scheduling)."""

from __future__ import annotations

from dataclasses import fields, replace

from deepinfer.engine.core.block_manager import BlockManager, cdiv
from deepinfer.engine.core.image_spans import fit_to_image_spans
from deepinfer.engine.core.request import Request, RequestStatus, child_seed
from deepinfer.engine.core.scheduler_output import SequenceUpdate, SpecDecodeStats
from deepinfer.engine.core.stop import StopDecision, check_new_token


def append_tokens(
    request: Request,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    max_model_len: int,
    now: float,
) -> tuple[list[int], StopDecision | None]:
    """Append tokens one by one until a stop condition; tokens after a stop are dropped.

    Returns the appended tokens and the stop that ended the sequence, if one did (the caller
    finishes the request: that frees what it holds).
    """
    if request.first_token_time is None:
        request.first_token_time = now
    all_token_ids = request.all_token_ids
    decision = None
    num_appended = 0
    for token_id in token_ids:
        all_token_ids.append(token_id)
        num_appended += 1
        decision = check_new_token(request, token_id, max_model_len)
        if decision is not None:
            break
    if logprobs:
        request.output_logprobs.extend(logprobs[:num_appended])
    return token_ids[:num_appended], decision


# ``sequence_update`` builds a SequenceUpdate positionally, per sequence per step: keywords
# cost about 1 us more a call. Its fields, in declaration order:
_UPDATE_FIELDS = (
    "request_id", "group_id", "index", "new_token_ids", "new_logprobs", "finished",
    "finish_reason", "stop_reason", "error", "new_text", "text_length", "prompt_logprobs",
    "num_preemptions", "num_verify_steps", "num_draft_tokens", "num_accepted_tokens",
    "draft_confidences",
)  # fmt: skip
if tuple(f.name for f in fields(SequenceUpdate)) != _UPDATE_FIELDS:
    raise ImportError("SequenceUpdate's fields changed: update sequence_update to match")


def sequence_update(
    request: Request,
    new_token_ids: list[int],
    new_logprobs: list[dict[int, float]],
    previous_text_len: int | None = None,
    spec_stats: SpecDecodeStats | None = None,
) -> SequenceUpdate:
    """The update reporting ``request``'s new tokens and text and, if it finished, how.

    ``spec_stats``: the step's verification counts; accepted drafts past a stop are not
    counted (the last emitted token is the step's final token).
    """
    text = request.text
    text_length = text.length
    if previous_text_len is None or previous_text_len == text_length:
        new_text = ""
    else:
        new_text = text.tail(text_length - previous_text_len)
    finished = request.status is RequestStatus.FINISHED
    if spec_stats is None:
        num_verify_steps, num_drafts, num_accepted, confidences = 0, 0, 0, None
    else:
        num_verify_steps, num_drafts = 1, spec_stats.num_draft_tokens
        num_accepted = max(0, min(spec_stats.num_accepted_tokens, len(new_token_ids) - 1))
        confidences = spec_stats.draft_confidences
    index = request.index
    return SequenceUpdate(
        request.request_id,
        request.group_id,
        index,
        new_token_ids,
        new_logprobs,
        finished,
        request.finish_reason,
        request.stop_reason,
        request.error,
        new_text,
        text_length,
        request.prompt_logprobs if finished and index == 0 else None,
        request.num_preemptions,
        num_verify_steps,
        num_drafts,
        num_accepted,
        confidences,
    )


def fork_children(parent: Request, block_manager: BlockManager, block_size: int) -> list[Request]:
    """Split a request whose prompt was just computed into its ``n`` samples.

    The parent becomes sample 0. Each child shares the blocks covering the prompt (ref
    counts; the partly filled last block is copied on first write) and takes one of the state
    slots reserved at admission; the scheduler registers the children and has the parent's
    state copied into their slots before the next forward.
    """
    num_computed = parent.num_computed_tokens
    num_shared = cdiv(num_computed, block_size)
    children = []
    for index in range(1, parent.num_pending_samples):
        child = Request(
            f"{parent.group_id}#{index}",
            parent.prompt_token_ids,
            parent.sampling_params,
            seed=child_seed(parent.seed, index),
            eos_token_ids=parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            group_id=parent.group_id,
            index=index,
            skip_special_tokens=parent.skip_special_tokens,
            has_user_seed=parent.has_user_seed,
        )
        child.num_computed_tokens = num_computed
        child.block_ids = block_manager.share(parent.block_ids[:num_shared])
        child.state_slot = parent.reserved_child_slots.pop(0)
        child.status = RequestStatus.RUNNING
        child.speculates = parent.speculates
        child.first_scheduled_time = parent.first_scheduled_time
        children.append(child)
    parent.num_pending_samples = 1
    return children


def final_updates(request: Request, num_unborn: int) -> list[SequenceUpdate]:
    """The updates of a request finished outside the token path: its own, and one per sample
    of an ``n > 1`` request that ended before forking."""
    update = sequence_update(request, [], [])
    unborn = [
        replace(
            update,
            request_id=f"{request.group_id}#{index}",
            index=index,
            new_text="",
            text_length=0,
            prompt_logprobs=None,
        )
        for index in range(1, num_unborn + 1)
    ]
    return [update, *unborn]


def mark_in_flight(request: Request, num_new: int, num_known: int, *, awaits: bool) -> None:
    """Count a just-scheduled step: its positions as computed (a rejected draft's are given
    back by ``update``) and, when it reaches the last known token, what it will sample: a
    placeholder token, or (drafts verified, a fork) a result the next input depends on.

    num_known: tokens not yet computed before the step, placeholders included.
    """
    request.num_computed_tokens += num_new
    if num_new < num_known:
        return  # a prefill chunk short of the end samples nothing
    if awaits:
        request.awaits_result = True
    else:
        request.num_placeholders += 1


def resolve_in_flight(request: Request) -> None:
    """The oldest step in flight of ``request`` returned its sampled tokens."""
    if request.awaits_result:
        request.awaits_result = False
    elif request.num_placeholders:
        request.num_placeholders -= 1


def can_run_ahead(request: Request, max_model_len: int) -> bool:
    """Whether the request's next step can be scheduled before the results of its step in
    flight: only after a plain sample (its token is fed on the executor's side) that cannot
    have reached ``max_tokens`` or ``max_model_len``."""
    if not request.num_placeholders:
        return not request.awaits_result
    if request.speculates or request.awaits_result:
        return False
    num_tokens = request.num_tokens + request.num_placeholders
    num_output = num_tokens - request.num_prompt_tokens
    return num_output < request.stop_conditions.max_tokens and num_tokens < max_model_len


def num_tokens_to_schedule(request: Request, budget: int, max_model_len: int) -> int:
    """Tokens the request's next step takes (within ``budget``; 0 while it cannot run ahead
    of its step in flight): the rest of its known tokens and drafts, up to ``max_model_len``."""
    if not can_run_ahead(request, max_model_len):
        return 0
    num_computed = request.num_computed_tokens
    known = len(request.all_token_ids) + request.num_placeholders
    wanted = known + len(request.spec_token_ids) - num_computed
    num_new = max(0, min(wanted, budget, max_model_len - num_computed))
    return fit_to_image_spans(request, num_new) if request.images else num_new


def take_drafts(request: Request, draft_token_ids: list[int], max_model_len: int) -> None:
    """Keep the executor's drafts for ``request``'s next step, to verify then."""
    request.speculates = True
    # drafts follow the newest token: stale once a later step of the request is in flight
    if request.status is RequestStatus.RUNNING and not request.num_placeholders:
        room = max_model_len - len(request.all_token_ids)
        request.spec_token_ids = list(draft_token_ids[: max(0, room)])
