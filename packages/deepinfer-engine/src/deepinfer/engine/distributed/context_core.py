"""Context parallelism in the data-parallel core: a long prompt is prefilled by its owner's CP
group before the owner decodes it.

With ``context_parallel_size=C`` the DP ranks form groups of C consecutive ranks. A prompt of at
least ``cp_min_tokens`` tokens is given an owner as any request is (the least loaded rank) but
waits in its group's queue instead of the owner's scheduler. Once every rank of the group can
hold the prompt (blocks for its positions, a state slot; the owner one per sample), each
reserves them and the group prefills the prompt's positions but the last (with speculative
decoding, but the last ``sliding_window + drafts``: the owner's step seeds the draft stages'
window rings with them), in chunks of at most ``C * max(max_num_batched_tokens, 16)`` rows
(every rank computes at least 16; a shorter prompt runs on its owner), one chunk per step:
each rank's ``SchedulerOutput`` of that step carries its
:class:`~deepinfer.engine.core.scheduler_output.ContextPrefill`, which its executor runs
before the step's own work. After the last chunk the request joins the
owner's scheduler as running with those positions computed (as a prefix-cache hit would), so
the owner's ordinary step computes the rest of the prompt and samples; the other ranks
free what they reserved. The prompt logprobs of the CP rows reach the request with that step.

A CP request preempted later recomputes on its owner alone, as any request does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from deepinfer.engine.core.block_manager import cdiv
from deepinfer.engine.core.request import Request, RequestStatus
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import ContextPrefill, SchedulerOutput
from deepinfer.engine.distributed.core import DataParallelCore, request_load

ROWS_PER_RANK = 16  # a CP chunk deals every rank at least this many rows (the split's pieces)


@dataclass
class _Job:
    """A CP prefill: its request, owner, per-rank reservation and chunk boundaries."""

    request: Request
    owner: int
    ranks: range
    blocks: dict[int, list[int]]
    slots: dict[int, list[int]]  # the owner's: one per sample
    bounds: list[int]
    num_done: int = 0

    @property
    def started(self) -> bool:
        return bool(self.blocks)


class ContextParallelCore(DataParallelCore):
    """:class:`DataParallelCore` whose long prompts are prefilled by CP groups."""

    def __init__(self, schedulers, ranks, *, context_parallel_size: int, cp_min_tokens: int,
                 num_tail_tokens: int = 1, **options) -> None:  # fmt: skip
        """``num_tail_tokens``: the last prompt positions the owner computes itself (with
        speculative decoding the draft stages' window, whose rings its step seeds)."""
        super().__init__(schedulers, ranks, **options)
        if num_tail_tokens < 1:
            raise ValueError(f"num_tail_tokens={num_tail_tokens}: expected at least 1")
        self.num_tail_tokens = num_tail_tokens
        if len(self.schedulers) % context_parallel_size:
            raise ValueError(
                f"context_parallel_size={context_parallel_size}: expected a divisor of the "
                f"{len(self.schedulers)} ranks"
            )
        self.cp = context_parallel_size
        self.cp_min_tokens = cp_min_tokens
        # per rank: CP requests aborted after a chunk ran, for its executor to forget
        self._dropped: list[set[str]] = [set() for _ in self.schedulers]
        self.jobs: list[deque[_Job]] = [deque() for _ in range(len(schedulers) // self.cp)]
        self.num_context_chunks = 0  # CP prefill chunks launched
        self._handed = False  # a request went to a scheduler after it scheduled this step

    def _all_jobs(self) -> Iterable[_Job]:
        return (job for queue in self.jobs for job in queue)

    def is_long(self, request: Request) -> bool:
        """Whether ``request`` is prefilled by its CP group."""
        rows = request.num_prompt_tokens - self.num_tail_tokens
        return (
            request.num_prompt_tokens >= self.cp_min_tokens
            and rows >= ROWS_PER_RANK * self.cp
            and not request.images
            and not request.num_computed_tokens
        )

    def rank_loads(self) -> list[int]:
        loads = super().rank_loads()
        for job in self._all_jobs():
            loads[job.owner] += request_load(job.request)
        return loads

    def add_request(self, request: Request) -> int:
        if not self.is_long(request):
            return super().add_request(request)
        loads = self.rank_loads()
        owner = loads.index(min(loads))
        rid = request.request_id
        if rid in self.schedulers[owner].requests or any(
            j.request.request_id == rid for j in self._all_jobs()
        ):
            raise ValueError(f"request id {rid!r} is already in use")
        group = owner // self.cp
        rows = request.num_prompt_tokens - self.num_tail_tokens
        budget = self.schedulers[owner].config.max_num_batched_tokens
        size = self.cp * max(budget, ROWS_PER_RANK)
        count = cdiv(rows, size)
        bounds = [rows * i // count for i in range(count + 1)]
        ranks = range(group * self.cp, (group + 1) * self.cp)
        self.jobs[group].append(_Job(request, owner, ranks, {}, {}, bounds))
        return owner

    def abort(self, group_ids: Iterable[str]) -> None:
        group_ids = set(group_ids)
        for queue in self.jobs:
            for job in [j for j in queue if j.request.group_id in group_ids]:
                queue.remove(job)
                if job.started:  # the owner's executor may keep its prompt logprobs
                    self._dropped[job.owner].add(job.request.request_id)
                self._release(job, keep_owner=False)
                self.schedulers[job.owner].add_request(job.request)  # reported by its abort
        super().abort(group_ids)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or any(self.jobs)

    def _launch(self, outputs: list[SchedulerOutput]):
        """Attach this step's CP chunks to the outputs (in place), then launch them."""
        chunks = {}
        for queue in self.jobs:
            job = self._next_job(queue)
            if job is not None:
                chunks.update(self._chunk(job))
                if job.num_done == len(job.bounds) - 1:
                    queue.popleft()
                    self._hand_to_owner(job)
        if chunks and self.every_rank_steps:  # the MoE exchanges reach every rank
            chunks = {rank: chunks.get(rank, ContextPrefill()) for rank in range(len(outputs))}
        for rank, chunk in chunks.items():
            outputs[rank] = replace(outputs[rank], context_prefill=chunk)
        for rank, dropped in enumerate(self._dropped):
            if dropped:
                finished = outputs[rank].finished_request_ids | dropped
                outputs[rank] = replace(outputs[rank], finished_request_ids=finished)
                dropped.clear()
        return super()._launch(outputs)

    def _update(self, outputs, results, check):
        """(A rank may schedule nothing while a CP prefill holds its blocks, or when its
        request arrived after it scheduled: not a stall.)"""
        busy = self._handed or any(so.context_prefill is not None for so in outputs)
        self._handed = False
        return super()._update(outputs, results, check and not busy)

    def _next_job(self, queue: deque[_Job]) -> _Job | None:
        """The group's job this step: the started one, else the first if it fits now (one
        that can never fit as a CP prefill goes to its owner's scheduler instead)."""
        while queue:
            job = queue[0]
            if job.started or self._reserve(job):
                return job
            group = [self.schedulers[rank] for rank in job.ranks]
            if any(s.requests for s in group) and self._ever_fits(job):
                return None  # wait for the group's requests to free room
            queue.popleft()
            self.schedulers[job.owner].add_request(job.request)
            self._handed = True
        return None

    def _num_blocks(self, job: _Job) -> int:
        scheduler = self.schedulers[job.owner]
        return scheduler.block_manager.num_blocks_for_tokens(job.bounds[-1])

    def _ever_fits(self, job: _Job) -> bool:
        needed = self._num_blocks(job)
        return all(needed <= self.schedulers[r].block_manager.num_usable_blocks for r in job.ranks)

    def _reserve(self, job: _Job) -> bool:
        """Reserve blocks and state slots on every rank of the group, or nothing."""
        needed = self._num_blocks(job)
        for rank in job.ranks:
            scheduler = self.schedulers[rank]
            num_slots = job.request.num_pending_samples if rank == job.owner else 1
            if not (
                scheduler.block_manager.can_allocate(needed)
                and scheduler.state_slots.can_allocate(num_slots)
            ):
                return False
        for rank in job.ranks:
            scheduler = self.schedulers[rank]
            num_slots = job.request.num_pending_samples if rank == job.owner else 1
            job.blocks[rank] = scheduler.block_manager.allocate(needed)
            job.slots[rank] = [scheduler.state_slots.allocate() for _ in range(num_slots)]
        job.request.first_scheduled_time = self.schedulers[job.owner].clock()
        return True

    def _chunk(self, job: _Job) -> dict[int, ContextPrefill]:
        """Each group rank's part in the job's next chunk."""
        start, end = job.bounds[job.num_done], job.bounds[job.num_done + 1]
        request = job.request
        job.num_done += 1
        self.num_context_chunks += 1
        return {
            rank: ContextPrefill(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start : end + 1],
                start=start,
                block_ids=job.blocks[rank],
                state_slot=job.slots[rank][0],
                is_first=start == 0,
                prompt_logprobs=getattr(request.sampling_params, "prompt_logprobs", None),
                is_owner=rank == job.owner,
            )
            for rank in job.ranks
        }

    def _hand_to_owner(self, job: _Job) -> None:
        """The last chunk is launched: the owner's scheduler runs the request from here (a
        rank runs its steps in launch order, so what is freed is reused only afterwards)."""
        self._release(job, keep_owner=True)
        self._handed = True
        admit_prefilled(
            self.schedulers[job.owner],
            job.request,
            job.blocks[job.owner],
            job.slots[job.owner],
            job.bounds[-1],
        )

    def _release(self, job: _Job, keep_owner: bool) -> None:
        for rank in job.ranks:
            if keep_owner and rank == job.owner or rank not in job.blocks:
                continue
            scheduler = self.schedulers[rank]
            scheduler.block_manager.free(job.blocks[rank])
            for slot in job.slots[rank]:
                scheduler.state_slots.free(slot)


def admit_prefilled(
    scheduler: Scheduler, request: Request, block_ids: list[int], slots: list[int], num: int
) -> None:
    """Add ``request`` to ``scheduler`` as running, its first ``num`` positions already in the
    cache at ``block_ids`` and state slot ``slots[0]`` (``slots[1:]``: its samples' slots)."""
    scheduler.add_request(request)
    scheduler.waiting.remove(request)
    request.block_ids, request.num_computed_tokens = list(block_ids), num
    request.state_slot, request.reserved_child_slots = slots[0], list(slots[1:])
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
