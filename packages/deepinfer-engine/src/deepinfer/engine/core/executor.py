"""The executor protocol: what ``EngineCore`` needs from whatever runs the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    """Runs one scheduled step and returns plain results.

    ``execute`` must, in this order: drop the ids in ``finished_request_ids`` and
    ``preempted_request_ids``; perform ``block_copies`` and ``state_copies``; register
    ``new_requests`` (a request with ``num_computed_tokens == 0`` starts from a clean state
    slot) and apply ``cached_requests`` diffs; compute ``num_scheduled_tokens[r]`` positions of
    each request from its ``num_computed_tokens``, writing their KV into its blocks and state
    slot; sample where a request's chunk reaches its last token (once per seed for
    ``fork_seeds``). A failure confined to one request goes in ``errors``; anything else raises.

    Asynchronous scheduling sends step N+1 before step N's output reached the scheduler:
    ``from_previous_sample`` requests take the token the executor sampled for them in its
    previous step as their last input. An executor may also offer
    ``execute_async(scheduler_output) -> StepResult``, returning once the step is queued on
    the device so the host can prepare the next one; its steps run in launch order. An
    executor that proposes drafts has ``num_draft_tokens`` > 0: no request then runs ahead
    of its results, as its next input depends on how many drafts get accepted.
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class StepResult(Protocol):
    """A launched step: ``result()`` waits for it and returns its output (once, then cached)."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class DoneStep:
    """A step that already ran (an executor without ``execute_async``)."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


def launch(executor: Executor, scheduler_output: SchedulerOutput) -> StepResult:
    """Start ``scheduler_output`` on ``executor``: its ``execute_async`` when it has one
    (returns once the device work is queued), else ``execute``."""
    execute_async = getattr(executor, "execute_async", None)
    if execute_async is not None:
        return execute_async(scheduler_output)
    return DoneStep(executor.execute(scheduler_output))
