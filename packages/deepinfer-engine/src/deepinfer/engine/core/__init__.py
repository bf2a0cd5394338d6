"""The engine core: requests, block manager, state slots, scheduler, stop handling.

Plain Python over plain data (no torch): ``EngineCore.step()`` = ``Scheduler.schedule()`` ->
``Executor.execute()`` -> ``Scheduler.update()``; the executor (the model runner, or the fake
one in :mod:`deepinfer.engine.testing.fake_executor`) is the only part that touches tensors.
"""

from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.detokenizer import IncrementalDetokenizer
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.executor import Executor
from deepinfer.engine.core.request import Request, RequestStatus, StopConditions
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SequenceUpdate,
    SpecDecodeStats,
)
from deepinfer.engine.core.state_slots import StateSlotPool

__all__ = [
    "BlockManager",
    "CachedRequestData",
    "EngineCore",
    "Executor",
    "IncrementalDetokenizer",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceUpdate",
    "SpecDecodeStats",
    "StateSlotPool",
    "StopConditions",
]
