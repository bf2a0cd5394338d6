"""deepinfer.parallel: the parallel layout (attention DP, MoE EP), expert placement, EPLB, and
the communication layer (collectives, dispatch/combine, process start-up)."""

from deepinfer.parallel.comm import Communicator, SingleProcessComm, TorchDistributedComm
from deepinfer.parallel.config import ParallelConfig, expert_owner, expert_range
from deepinfer.parallel.dispatch import (
    DispatchHandle,
    combine,
    dispatch,
    dispatch_pairs,
    group_by_slot,
)
from deepinfer.parallel.eplb import (
    ExpertLoadWindow,
    align_slots,
    imbalance,
    rank_loads,
    rebalance,
    weight_moves,
)
from deepinfer.parallel.expert_parallel import ExpertParallelContext, move_slots
from deepinfer.parallel.launch import (
    DistributedEnv,
    WorkerError,
    default_backend,
    find_free_port,
    init_from_env,
    init_process_group,
    read_env,
    spawn,
)
from deepinfer.parallel.placement import (
    ExpertPlacement,
    PlacementTensors,
    initial_placement,
    route_to_slots,
)
from deepinfer.parallel.version import __version__

__all__ = [
    "Communicator",
    "DispatchHandle",
    "DistributedEnv",
    "ExpertLoadWindow",
    "ExpertParallelContext",
    "ExpertPlacement",
    "ParallelConfig",
    "PlacementTensors",
    "SingleProcessComm",
    "TorchDistributedComm",
    "WorkerError",
    "__version__",
    "align_slots",
    "combine",
    "default_backend",
    "dispatch",
    "dispatch_pairs",
    "expert_owner",
    "expert_range",
    "find_free_port",
    "group_by_slot",
    "imbalance",
    "init_from_env",
    "init_process_group",
    "initial_placement",
    "move_slots",
    "rank_loads",
    "read_env",
    "rebalance",
    "route_to_slots",
    "spawn",
    "weight_moves",
]
