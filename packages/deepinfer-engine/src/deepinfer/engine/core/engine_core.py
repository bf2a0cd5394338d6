"""``EngineCore.step()`` = schedule -> execute -> update. Nothing else goes inside.

Asynchronous scheduling (``async_scheduling=True``) keeps one step in flight: each call
schedules and launches step N+1, then waits for step N and applies its output. While the
device runs a step the host schedules, prepares and post-processes. A request whose step N
samples one plain token is scheduled in N+1 with a placeholder for it (the executor feeds the
token it sampled itself); stops are found one step late, and what N+1 computed for a request
that N finished is dropped by ``Scheduler.update``, so outputs equal the synchronous loop's.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.engine.core.executor import Executor, StepResult, launch
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    SequenceUpdate,
)

_NOTHING_RAN = ModelRunnerOutput()


class EngineCore:
    """The engine loop over a scheduler and an executor."""

    def __init__(
        self, scheduler: Scheduler, executor: Executor, *, async_scheduling: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # a drafting executor's next input depends on how many drafts get accepted
        scheduler.speculative = getattr(executor, "num_draft_tokens", 0) > 0
        self.async_scheduling = async_scheduling
        self.num_steps = 0  # steps that computed tokens
        self._in_flight: tuple[SchedulerOutput, StepResult] | None = None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, group_ids: Iterable[str]) -> None:
        """Finish these requests (all their samples) with ``"abort"`` at the next step."""
        self.scheduler.abort_requests(group_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished (a step still in flight then holds only work
        past the end of finished requests: the next step drops it)."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[SequenceUpdate]:
        """Run one step; return what changed per sequence.

        With nothing to run the executor is not called; the update still reports requests
        finished outside the token path (aborts, requests that can never fit). Raises if
        unfinished requests remain but nothing could be scheduled (a configuration error such
        as fewer state slots than samples of one request).
        """
        if self.async_scheduling:
            return self._step_ahead()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            runner_output = _NOTHING_RAN
        else:
            runner_output = self.executor.execute(scheduler_output)
            self.num_steps += bool(scheduler_output.num_scheduled_tokens)
        updates = self.scheduler.update(scheduler_output, runner_output)
        self._check_stalled(scheduler_output, updates)
        return updates

    def _step_ahead(self) -> list[SequenceUpdate]:
        """Launch the next step, then apply the one in flight (see the module docstring)."""
        updates: list[SequenceUpdate] = []
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.num_scheduled_tokens and self._in_flight is not None:
            # every runnable request waits for the step in flight: finish it, schedule again
            updates = self._finish_in_flight()
            if not scheduler_output.is_empty:  # the diffs (finished ids, copies) still go out
                output = launch(self.executor, scheduler_output).result()
                self.scheduler.update(scheduler_output, output)
            scheduler_output = self.scheduler.schedule()
        launched = None
        if not scheduler_output.is_empty:
            launched = (scheduler_output, launch(self.executor, scheduler_output))
            self.num_steps += bool(scheduler_output.num_scheduled_tokens)
        if self._in_flight is not None:
            updates += self._finish_in_flight()
        elif launched is None:
            updates += self.scheduler.update(scheduler_output, _NOTHING_RAN)
        self._in_flight = launched
        if launched is None:
            self._check_stalled(scheduler_output, updates)
        return updates

    def _finish_in_flight(self) -> list[SequenceUpdate]:
        assert self._in_flight is not None
        scheduler_output, result = self._in_flight
        self._in_flight = None
        return self.scheduler.update(scheduler_output, result.result())

    def _check_stalled(self, scheduler_output: SchedulerOutput, updates) -> None:
        stalled = not scheduler_output.num_scheduled_tokens and not updates
        if stalled and self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"the scheduler could not schedule any of "
                f"{self.scheduler.num_unfinished_requests} unfinished requests "
                f"(free blocks {self.scheduler.block_manager.num_free_blocks}, free state "
                f"slots {self.scheduler.state_slots.num_free_slots})"
            )
