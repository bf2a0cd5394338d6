"""``EngineCore.step()`` = schedule -> execute -> update. Nothing else goes inside."""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.engine.core.executor import Executor
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SequenceUpdate

_NOTHING_RAN = ModelRunnerOutput()


class EngineCore:
    """The engine loop over a scheduler and an executor."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, group_ids: Iterable[str]) -> None:
        """Finish these requests (all their samples) with ``"abort"`` at the next step."""
        self.scheduler.abort_requests(group_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[SequenceUpdate]:
        """Run one step; return what changed per sequence.

        With nothing to run the executor is not called; the update still reports requests
        finished outside the token path (aborts, requests that can never fit). Raises if
        unfinished requests remain but nothing could be scheduled (a configuration error such
        as fewer state slots than samples of one request).
        """
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            runner_output = _NOTHING_RAN
        else:
            runner_output = self.executor.execute(scheduler_output)
            self.num_steps += 1
        updates = self.scheduler.update(scheduler_output, runner_output)
        stalled = not scheduler_output.num_scheduled_tokens and not updates
        if stalled and self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"the scheduler could not schedule any of "
                f"{self.scheduler.num_unfinished_requests} unfinished requests "
                f"(free blocks {self.scheduler.block_manager.num_free_blocks}, free state "
                f"slots {self.scheduler.state_slots.num_free_slots})"
            )
        return updates
