"""The executor of an expert-parallel rank: every step reaches the MoE collectives, and EPLB
runs between steps.

The data-parallel core steps every rank together; a rank with nothing scheduled (or whose
requests all failed) gets a step in which its model does not run, so the wrapper runs an
:func:`~deepinfer.engine.model.expert_parallel.idle_step` instead, and the other ranks' MoE
exchanges find it. After each step, idle or not, the :class:`~.eplb.EplbController` counts it
and rebalances on its interval, on every rank at the same step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.model.expert_parallel import expert_parallel_layers, idle_step
from deepinfer.engine.runner.eplb import EplbController


class ExpertParallelExecutor:
    """Wraps a rank's runner (``execute``; every other attribute is the runner's)."""

    # steps run one at a time (the all-to-all sizes are read on the host anyway): hide the
    # runner's asynchronous launch, so every step goes through execute
    execute_async = None

    def __init__(self, runner: Any, model: nn.Module, eplb_interval: int = 0) -> None:
        self.runner, self.model = runner, model
        self.layers = expert_parallel_layers(model)
        if not self.layers:
            raise ValueError("ExpertParallelExecutor: the model has no expert-parallel layers")
        self.eplb = EplbController(model, eplb_interval) if eplb_interval else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        slots = self.layers[0].ep
        before = slots.num_forwards
        out = self.runner.execute(scheduler_output)
        if slots.num_forwards == before:
            idle_step(self.model)
        if self.eplb is not None:
            self.eplb.after_step()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)
