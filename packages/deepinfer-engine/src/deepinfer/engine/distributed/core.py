"""The engine core of attention data parallelism: one scheduler per DP rank, in lockstep.

Each DP rank owns its requests, KV cache and state slots, so it has its own :class:`Scheduler`
(plain Python, kept here in the front end next to the tokenizer) and its own executor (in the
rank's worker process). A step schedules every rank, runs the ranks' steps together through a
:class:`RankGroup`, and updates every scheduler with its rank's results. A new request goes to
the rank with the fewest tokens left to compute (queued prompt tokens plus the tokens still to
generate of everything it holds), so long prompts do not pile up on one rank.

With expert parallelism every rank takes part in each step even with nothing scheduled: its
executor gets the empty ``SchedulerOutput`` and still runs the MoE exchange with zero tokens,
so the collectives of all ranks match. Without it, idle ranks sit the step out.

Asynchronous scheduling works as in :class:`~deepinfer.engine.core.engine_core.EngineCore`,
over all ranks at once: each step schedules every rank and sends the ranks step N+1 (a rank
group with ``launch``) before it collects step N, so the front end's scheduling and output
processing overlap the ranks' work; a rank runs its steps in the order sent. A rank group
without ``launch`` (torchrun's) steps synchronously.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    SequenceUpdate,
)

_NOTHING_RAN = ModelRunnerOutput()


class RankGroup(Protocol):
    """The executors of the DP ranks, stepped together."""

    world_size: int

    def execute(self, outputs: dict[int, SchedulerOutput]) -> dict[int, ModelRunnerOutput]:
        """Run each given rank's step (all at once); the results by rank. A group may also
        offer ``launch(outputs)``, returning once the steps are sent, with ``result()`` (the
        same dict) to wait for them; each rank runs its steps in launch order."""
        ...

    def end_call(self) -> None:
        """A user call (``generate``, ``chat``) is over: ranks that follow it may return."""
        ...

    def close(self) -> None:
        """Stop the ranks' workers (idempotent)."""
        ...


def request_load(request: Request) -> int:
    """Tokens a request still costs its rank: prompt positions to compute plus tokens to
    generate, for each of its samples."""
    left_to_generate = max(0, request.stop_conditions.max_tokens - request.num_output_tokens)
    to_compute = request.num_tokens - request.num_computed_tokens
    return to_compute + left_to_generate * max(1, request.num_pending_samples)


@dataclass(frozen=True)
class _Done:
    """Steps that already ran (a rank group without ``launch``, or nothing to run)."""

    results: dict[int, ModelRunnerOutput]

    def result(self) -> dict[int, ModelRunnerOutput]:
        return self.results


class DataParallelCore:
    """``EngineCore``'s interface over ``len(schedulers)`` DP ranks (``every_rank_steps``: the
    ranks run MoE collectives, so each step reaches every rank; ``async_scheduling`` applies
    when ``ranks`` has ``launch``; ``speculative``: the ranks' executors propose drafts)."""

    def __init__(
        self,
        schedulers: Sequence[Scheduler],
        ranks: RankGroup,
        *,
        every_rank_steps: bool,
        async_scheduling: bool = False,
        speculative: bool = False,
    ) -> None:
        if len(schedulers) != ranks.world_size:
            raise ValueError(
                f"schedulers: expected one per rank ({ranks.world_size}), got {len(schedulers)}"
            )
        self.schedulers = list(schedulers)
        for scheduler in self.schedulers:
            scheduler.speculative = speculative
        self.ranks = ranks
        self.every_rank_steps = every_rank_steps
        self.async_scheduling = async_scheduling and hasattr(ranks, "launch")
        self.num_steps = 0
        self._in_flight: tuple[list[SchedulerOutput], Any] | None = None

    @property
    def scheduler(self) -> Scheduler:
        """Where requests refused at submission go (rank 0's scheduler: they finish with their
        error at the next update and never run)."""
        return self.schedulers[0]

    def rank_loads(self) -> list[int]:
        """Per rank, the tokens its requests still cost (see :func:`request_load`)."""
        return [sum(map(request_load, s.requests.values())) for s in self.schedulers]

    def add_request(self, request: Request) -> int:
        """Queue ``request`` on the least loaded rank (the lowest such rank); returns the rank."""
        loads = self.rank_loads()
        rank = loads.index(min(loads))
        self.schedulers[rank].add_request(request)
        return rank

    def abort(self, group_ids: Iterable[str]) -> None:
        group_ids = set(group_ids)
        for scheduler in self.schedulers:
            scheduler.abort_requests(group_ids)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def step(self) -> list[SequenceUpdate]:
        """One lockstep step of every rank; what changed per sequence, rank by rank."""
        if self.async_scheduling:
            return self._step_ahead()
        outputs = [s.schedule() for s in self.schedulers]
        launched = self._launch(outputs)
        return self._update(outputs, launched.result() if launched else {}, check=True)

    def _step_ahead(self) -> list[SequenceUpdate]:
        """Launch the next step of every rank, then apply the one in flight (as
        ``EngineCore`` does for one scheduler)."""
        updates: list[SequenceUpdate] = []
        outputs = [s.schedule() for s in self.schedulers]
        if self._in_flight is not None and not any(so.num_scheduled_tokens for so in outputs):
            # every runnable request waits for the step in flight: finish it, schedule again
            updates = self._finish_in_flight()
            diffs = self._launch(outputs)  # finished ids and copies still go out
            updates += self._update(outputs, diffs.result() if diffs else {}, check=False)
            outputs = [s.schedule() for s in self.schedulers]
        launched = self._launch(outputs)
        if self._in_flight is not None:
            updates += self._finish_in_flight()
        elif launched is None:
            updates += self._update(outputs, {}, check=True)
        self._in_flight = (outputs, launched) if launched is not None else None
        return updates

    def _launch(self, outputs: list[SchedulerOutput]) -> Any:
        """Send the ranks with work (every rank under EP) their step; None if none has any."""
        busy = {rank: so for rank, so in enumerate(outputs) if not so.is_empty}
        if not busy:
            return None
        if self.every_rank_steps:
            busy = dict(enumerate(outputs))
        self.num_steps += 1
        if self.async_scheduling:
            return self.ranks.launch(busy)
        return _Done(self.ranks.execute(busy))

    def _finish_in_flight(self) -> list[SequenceUpdate]:
        assert self._in_flight is not None
        outputs, launched = self._in_flight
        self._in_flight = None
        return self._update(outputs, launched.result(), check=False)

    def _update(
        self, outputs: list[SchedulerOutput], results: dict[int, ModelRunnerOutput], check: bool
    ) -> list[SequenceUpdate]:
        """Apply each rank's results (``check``: raise for a rank that can never schedule)."""
        updates: list[SequenceUpdate] = []
        for rank, (scheduler, so) in enumerate(zip(self.schedulers, outputs)):
            rank_updates = scheduler.update(so, results.get(rank, _NOTHING_RAN))
            stalled = check and not so.num_scheduled_tokens and not rank_updates
            if stalled and scheduler.has_unfinished_requests():
                raise RuntimeError(
                    f"rank {rank}: the scheduler could not schedule any of "
                    f"{scheduler.num_unfinished_requests} unfinished requests (free blocks "
                    f"{scheduler.block_manager.num_free_blocks}, free state slots "
                    f"{scheduler.state_slots.num_free_slots})"
                )
            updates += rank_updates
        return updates

    def end_call(self) -> None:
        self.ranks.end_call()

    def close(self) -> None:
        self.ranks.close()
