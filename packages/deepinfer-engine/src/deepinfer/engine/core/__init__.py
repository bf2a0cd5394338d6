"""The engine core: requests, block manager, state slots, scheduler, stop handling, outputs.

Plain Python over plain data (no torch): ``EngineCore.step()`` = ``Scheduler.schedule()`` ->
``Executor.execute()`` -> ``Scheduler.update()``; the executor (the model runner, or the fake
one in :mod:`deepinfer.engine.core.testing`) is the only part that touches tensors.
"""

from deepinfer.engine.core.batch_plan import RunnerState, StepPlan, build_step_plan
from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.capacity import CacheCapacity, plan_cache_capacity
from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.detokenizer import IncrementalDetokenizer
from deepinfer.engine.core.engine_config import EngineConfig, LoadedModel
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.executor import Executor
from deepinfer.engine.core.output_processor import OutputProcessor
from deepinfer.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
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
from deepinfer.engine.core.validation import InvalidRequestError, validate_batch

__all__ = [
    "BlockManager",
    "CacheCapacity",
    "CachedRequestData",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "Executor",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "LoadedModel",
    "ModelRunnerOutput",
    "NewRequestData",
    "OutputProcessor",
    "Request",
    "RequestMetrics",
    "RunnerState",
    "StepPlan",
    "RequestOutput",
    "RequestStatus",
    "Scheduler",
    "SpecDecodeStats",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceUpdate",
    "StateSlotPool",
    "StopConditions",
    "build_step_plan",
    "plan_cache_capacity",
    "validate_batch",
]
