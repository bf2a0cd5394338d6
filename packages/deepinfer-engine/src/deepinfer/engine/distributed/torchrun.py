"""The DP ranks as the processes ``torchrun`` started: every process runs the user's script.

Each process loads its rank's model and cache. Rank 0 is the front end: its ``LLM`` holds every
rank's scheduler and steps the ranks through :class:`TorchrunRanks`, sending each step's work
over a gloo control group and running its own rank's share in place. On the other ranks the
``LLM`` is a :class:`TorchrunFollower`: each ``generate`` / ``chat`` call serves rank 0's steps
until rank 0's matching call ends, and returns an empty list (rank 0 returns the outputs). So
every rank must make the same calls in the same order, as with any torchrun program. A rank
that fails raises in its own script; torchrun then stops the others.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from deepinfer.engine.config import EngineConfig, LoadedModel
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.distributed.worker import load_rank
from deepinfer.parallel import DistributedEnv, init_from_env

# Followers wait in the control group while rank 0's script does anything between calls.
CONTROL_TIMEOUT_FACTOR = 30


def join_torchrun(config: EngineConfig, env: DistributedEnv, backend: str) -> LoadedModel:
    """Form the groups, load this rank, agree on the cache capacity; rank 0's executor is a
    :class:`TorchrunRanks`, the others' a :class:`TorchrunFollower`."""
    if env.world_size != config.data_parallel_size:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size}: expected torchrun's "
            f"WORLD_SIZE={env.world_size} (one rank per process)"
        )
    if not dist.is_initialized():
        init_from_env(backend, timeout_s=config.distributed_timeout_s)
    timeout = timedelta(seconds=config.distributed_timeout_s * CONTROL_TIMEOUT_FACTOR)
    control = dist.new_group(backend="gloo", timeout=timeout)
    loaded = load_rank(config)
    capacities: list[Any] = [None] * env.world_size
    dist.all_gather_object(capacities, (loaded.num_blocks, loaded.num_state_slots), group=control)
    loaded = replace(
        loaded,
        num_blocks=min(c[0] for c in capacities),
        num_state_slots=min(c[1] for c in capacities),
    )
    if env.rank == 0:
        return replace(loaded, executor=TorchrunRanks(loaded.executor, control, env.world_size))
    return replace(loaded, executor=TorchrunFollower(loaded.executor, control))


class TorchrunRanks:
    """Rank 0's :class:`~.core.RankGroup`: its own executor here, the others' over ``control``."""

    def __init__(self, executor: Any, control: Any, world_size: int) -> None:
        self.executor = executor
        self.control = control
        self.world_size = world_size
        # drafts the ranks' executors propose (every rank's are configured alike)
        self.num_draft_tokens = getattr(executor, "num_draft_tokens", 0)

    def execute(self, outputs: dict[int, SchedulerOutput]) -> dict[int, ModelRunnerOutput]:
        self._send(
            [
                ("execute", outputs[r]) if r in outputs else ("skip", None)
                for r in range(self.world_size)
            ]
        )
        mine = self.executor.execute(outputs[0]) if 0 in outputs else None
        gathered: list[Any] = [None] * self.world_size
        dist.gather_object(mine, gathered, dst=0, group=self.control)
        return {rank: gathered[rank] for rank in outputs}

    def end_call(self) -> None:
        self._send([("done", None)] * self.world_size)

    def close(self) -> None:
        pass  # the processes belong to torchrun

    def _send(self, messages: list[tuple[str, Any]]) -> None:
        received: list[Any] = [None]
        dist.scatter_object_list(received, messages, src=0, group=self.control)


class TorchrunFollower:
    """A rank other than 0: serves rank 0's steps, one user call at a time."""

    is_follower = True

    def __init__(self, executor: Any, control: Any) -> None:
        self.executor = executor
        self.control = control

    def serve_call(self) -> None:
        """Run rank 0's steps until its current call ends."""
        while True:
            received: list[Any] = [None]
            dist.scatter_object_list(received, None, src=0, group=self.control)
            kind, so = received[0]
            if kind == "done":
                return
            result = self.executor.execute(so) if kind == "execute" else None
            dist.gather_object(result, None, dst=0, group=self.control)

    def close(self) -> None:
        pass
