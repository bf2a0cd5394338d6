"""The executor protocol: what ``EngineCore`` needs from whatever runs the model."""

from __future__ import annotations

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
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
