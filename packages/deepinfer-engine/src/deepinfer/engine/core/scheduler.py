"""Token-budget scheduler: plain Python over plain data, no tensors.

Every sequence has ``num_computed_tokens`` chasing its ``num_tokens`` (+ drafts). Each step:

1. Running sequences first, in admission order: each takes what it still lacks (the rest of
   its prompt chunk by chunk, 1 for a decode, 1 + drafts for verification) within the token
   budget. When blocks run out, the most recently admitted running sequence is preempted by
   recompute (blocks and state slot freed, back to the front of the waiting queue) until the
   current one fits, or it is itself the one preempted.
2. Then, if nobody was preempted this step, waiting requests in FCFS order while the budget,
   ``max_num_seqs``, state slots and blocks allow; the last one admitted may get a partial
   prompt chunk (chunked prefill). A request whose tokens need more blocks than the whole
   pool finishes alone with finish reason ``"error"`` and a message.

A scheduled step counts as computed at once and is in flight (``updates.mark_in_flight``)
until ``update`` applies its results: gives back rejected drafts' positions, appends sampled
tokens, runs stop checks, forks ``n > 1`` requests, frees what finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from deepinfer.engine.core.block_manager import BlockManager, cdiv
from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.detokenizer import IncrementalDetokenizer, TokenBytes
from deepinfer.engine.core.executor_view import ExecutorView
from deepinfer.engine.core.image_spans import fit_to_image_spans
from deepinfer.engine.core.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    Request,
    RequestStatus,
    request_seeds,
)
from deepinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SequenceUpdate,
)
from deepinfer.engine.core.state_slots import StateSlotPool
from deepinfer.engine.core.updates import (
    append_tokens,
    final_updates,
    fork_children,
    mark_in_flight,
    num_tokens_to_schedule,
    resolve_in_flight,
    sequence_update,
    take_drafts,
)


class Scheduler:
    """FCFS token-budget scheduler with chunked prefill and preemption by recompute."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # byte-level tokenizers: token bytes shared by every request's detokeniser
        self._token_bytes = TokenBytes.of(tokenizer) if tokenizer is not None else None
        self.clock = clock
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.state_slots = StateSlotPool(config.num_state_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._view = ExecutorView()
        self._pending_state_copies: list[tuple[int, int]] = []
        self._pending_updates: list[SequenceUpdate] = []
        self.num_preemptions, self.speculative = 0, False  # speculative: set by EngineCore

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a new request (its group id and future child ids must be unused)."""
        n = request.num_pending_samples
        ids = [request.request_id] + [f"{request.group_id}#{k}" for k in range(1, n)]
        for rid in ids:
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        self.attach_detokenizer(request)
        request.speculates = request.speculates or self.speculative
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reject_request(self, request: Request, message: str) -> None:
        """Finish a new request with ``"error"`` and ``message`` without running it (its input
        failed a check at submission that concerns it alone); reported by the next update."""
        self.add_request(request)
        self._finish(request, FINISH_ERROR, error=message)

    def abort_requests(self, group_ids: Iterable[str]) -> None:
        """Finish every sequence of these groups with ``"abort"`` (reported by the next update)."""
        wanted = set(group_ids)
        for request in [r for r in self.requests.values() if r.group_id in wanted]:
            self._finish(request, FINISH_ABORT)

    def attach_detokenizer(self, request: Request) -> None:
        """Give ``request`` an incremental detokeniser (when the engine has a tokenizer)."""
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.skip_special_tokens,
                token_bytes=self._token_bytes,
            )

    def queue_state_copy(self, src_slot: int, dst_slot: int) -> None:
        """Have the executor copy state slot ``src_slot`` into ``dst_slot`` before the next forward."""
        self._pending_state_copies.append((src_slot, dst_slot))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending_updates)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work (see the module docstring)."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        replaced: dict[str, list[tuple[int, int]]] = {}
        block_copies: list[tuple[int, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled, replaced, block_copies)
        if not preempted:
            self._schedule_waiting(budget, scheduled, replaced, block_copies)
        return self._build_output(scheduled, replaced, block_copies)

    def _schedule_running(self, budget, scheduled, replaced, block_copies) -> tuple[int, bool]:
        preempted = False
        running, can_allocate = self.running, self.block_manager.can_allocate
        max_model_len = self.config.max_model_len
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = num_tokens_to_schedule(request, budget, max_model_len)
            if num_new == 0:
                index += 1
                continue
            needed = self._blocks_needed(request, num_new)
            while not can_allocate(needed[0] + needed[1]):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                needed = self._blocks_needed(request, num_new)  # a victim may have shared one
            else:
                if needed[0] or needed[1]:  # (most decodes need no block)
                    self._allocate(request, needed, replaced, block_copies)
                scheduled[request.request_id] = num_new
                budget -= num_new
                index += 1
                continue
            break
        return budget, preempted

    def _schedule_waiting(self, budget, scheduled, replaced, block_copies) -> None:
        config = self.config
        while self.waiting and budget > 0:
            request = self.waiting[0]
            num_seqs = request.num_pending_samples
            if request.num_placeholders or len(self.running) + num_seqs > config.max_num_seqs:
                break  # (a preempted request waits for its step in flight)
            if not self.state_slots.can_allocate(num_seqs):
                break
            if self._fail_if_never_fits(request):
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            num_new = fit_to_image_spans(request, num_new)
            needed = self._blocks_needed(request, num_new)
            if num_new == 0 or not self.block_manager.can_allocate(needed[0] + needed[1]):
                break
            self.waiting.popleft()
            request.state_slot = self.state_slots.allocate()
            request.reserved_child_slots = [
                self.state_slots.allocate() for _ in range(num_seqs - 1)
            ]
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            self.running.append(request)
            self._allocate(request, needed, replaced, block_copies)
            scheduled[request.request_id] = num_new
            budget -= num_new

    def _blocks_needed(self, request: Request, num_new: int) -> tuple[int, bool]:
        """(new blocks to append, whether the first block written is shared: copy on write)."""
        config = self.config
        num_computed, block_ids = request.num_computed_tokens, request.block_ids
        end = min(num_computed + num_new, config.max_model_len)
        num_append = cdiv(end + config.num_lookahead_tokens, config.block_size) - len(block_ids)
        first = num_computed // config.block_size
        shared = first < len(block_ids) and self.block_manager.ref_count(block_ids[first]) > 1
        return (num_append, shared) if num_append > 0 else (0, shared)

    def _allocate(self, request, needed: tuple[int, bool], replaced, block_copies) -> None:
        """Take the blocks ``_blocks_needed`` counted (a private copy of a shared one first)."""
        num_append, shared = needed
        if shared:
            first = request.num_computed_tokens // self.config.block_size
            old = request.block_ids[first]
            new = self.block_manager.copy_on_write(old)
            assert new is not None
            request.block_ids[first] = new
            block_copies.append((old, new))
            replaced.setdefault(request.request_id, []).append((first, new))
        if num_append:
            request.block_ids.extend(self.block_manager.allocate(num_append))

    def _fail_if_never_fits(self, request: Request) -> bool:
        """Fail (and dequeue) a request whose tokens need more blocks than the whole pool."""
        num_positions = request.num_tokens + self.config.num_lookahead_tokens
        needed = cdiv(num_positions, self.config.block_size)
        available = self.block_manager.num_usable_blocks
        if needed <= available:
            return False
        self.waiting.popleft()
        message = (
            f"request {request.group_id!r} needs {needed} KV-cache blocks for {request.num_tokens} "
            f"tokens but the cache holds only {available} (block_size {self.config.block_size}); "
            "raise gpu_memory_utilization or shorten the request"
        )
        self._finish(request, FINISH_ERROR, error=message)
        return True

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and slots and requeue it at the front (recompute)."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.prompt_logprobs = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._view.forget(request.request_id, preempted=True)
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        for slot in [request.state_slot, *request.reserved_child_slots]:
            if slot is not None:
                self.state_slots.free(slot)
        request.state_slot = None
        request.reserved_child_slots = []

    def _build_output(self, scheduled, replaced, block_copies) -> SchedulerOutput:
        new_requests, cached_requests = [], []
        spec: dict[str, list[int]] = {}
        fork_seeds: dict[str, list[int]] = {}
        from_previous: set[str] = set()
        requests, describe = self.requests, self._view.describe
        for request_id, num_new in scheduled.items():
            request = requests[request_id]
            num_placeholders = request.num_placeholders
            if num_placeholders:
                from_previous.add(request_id)
            data = describe(request, replaced.get(request_id, ()) if replaced else ())
            (new_requests if isinstance(data, NewRequestData) else cached_requests).append(data)
            num_known = len(request.all_token_ids) + num_placeholders - request.num_computed_tokens
            awaits = num_new > num_known
            if awaits:
                spec[request_id] = request.spec_token_ids[: num_new - num_known]
            if request.num_pending_samples > 1 and num_new >= num_known:  # forks on prompt end
                fork_seeds[request_id] = request_seeds(request)
                awaits = True
            mark_in_flight(request, num_new, num_known, awaits=awaits)
        finished, preempted = self._view.take_forgotten()
        state_copies, self._pending_state_copies = self._pending_state_copies, []
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=scheduled,
            scheduled_spec_token_ids=spec,
            fork_seeds=fork_seeds,
            from_previous_sample=from_previous,
            block_copies=block_copies,
            state_copies=state_copies,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
        )

    # ------------------------------------------------------------------ update
    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceUpdate]:
        """Apply one step's results; return what changed per sequence (finished ones too)."""
        updates: list[SequenceUpdate] = []
        now = self.clock()
        requests, errors = self.requests, runner_output.errors
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.status is RequestStatus.FINISHED:
                continue  # aborted after scheduling
            if errors and request_id in errors:
                self._finish(request, FINISH_ERROR, error=errors[request_id])
                continue
            self._apply_step(request, scheduler_output, runner_output, now, updates)
        if self._pending_updates:
            updates, self._pending_updates = updates + self._pending_updates, []
        return updates  # (mark_finished took the finished ones out of ``running``)

    def _apply_step(self, request, scheduler_output, runner_output, now, updates) -> None:
        """Apply one request's step results; append its sequences' updates to ``updates``."""
        request_id = request.request_id
        sampled = runner_output.sampled_token_ids.get(request_id)
        is_running = request.status is RequestStatus.RUNNING  # (else preempted since: recomputes)
        drafts = scheduler_output.scheduled_spec_token_ids.get(request_id)
        if drafts and sampled and is_running:
            request.num_computed_tokens -= len(drafts) + 1 - len(sampled)  # rejected drafts
        if request.spec_token_ids:
            request.spec_token_ids = []
        prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
        if prompt_logprobs and is_running:  # a preempted one recomputes them
            request.prompt_logprobs.extend(prompt_logprobs)
        if not sampled:
            return
        resolve_in_flight(request)
        logprobs = runner_output.logprobs.get(request_id, [])
        if request_id in scheduler_output.fork_seeds:
            if not is_running:
                return  # preempted before its fork: the recompute forks again
            sequences = [request, *self._fork(request)]
            for k, (seq, tok) in enumerate(zip(sequences, sampled)):
                updates.append(self._append_sampled(seq, [tok], logprobs[k : k + 1], now))
            return
        stats = runner_output.spec_stats.get(request_id)  # (None: no drafts verified)
        updates.append(self._append_sampled(request, sampled, logprobs, now, stats))
        new_drafts = runner_output.draft_token_ids.get(request_id)
        if new_drafts:
            take_drafts(request, new_drafts, self.config.max_model_len)

    def _append_sampled(self, request, token_ids, logprobs, now, stats=None) -> SequenceUpdate:
        previous_len = request.text.length
        appended, stop = append_tokens(request, token_ids, logprobs, self.config.max_model_len, now)
        if stop is not None:
            self.mark_finished(request, stop.finish_reason, stop_reason=stop.stop_reason)
        if logprobs:
            logprobs = logprobs[: len(appended)]
        return sequence_update(request, appended, logprobs, previous_len, stats)

    def _fork(self, parent: Request) -> list[Request]:
        """Fork ``parent`` into its samples; they run right after it in the running order."""
        children = fork_children(parent, self.block_manager, self.config.block_size)
        assert parent.state_slot is not None
        for child in children:
            self.attach_detokenizer(child)
            self.queue_state_copy(parent.state_slot, child.state_slot)
            self.requests[child.request_id] = child
        position = self.running.index(parent) + 1
        self.running[position:position] = children
        return children

    def _finish(
        self, request: Request, reason: str, *, stop_reason=None, error: str | None = None
    ) -> None:
        """Finish ``request`` outside ``update``'s token path (abort, error, never fits).

        A request that ends before its ``n > 1`` samples forked reports them finished too.
        """
        num_unborn = request.num_pending_samples - 1
        self.mark_finished(request, reason, stop_reason=stop_reason, error=error)
        self._pending_updates.extend(final_updates(request, num_unborn))

    def mark_finished(
        self, request: Request, reason: str, *, stop_reason=None, error: str | None = None
    ) -> None:
        """Set the finish state and free everything the request holds."""
        if request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        if request.status is RequestStatus.RUNNING:
            self._release(request)
            if request in self.running:
                self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        request.finished_time = self.clock()
        self.requests.pop(request.request_id, None)
        self._view.forget(request.request_id, preempted=False)
