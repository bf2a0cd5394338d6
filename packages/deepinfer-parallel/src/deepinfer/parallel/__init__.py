"""deepinfer.parallel: the parallel layout (attention DP, MoE EP), expert placement and EPLB."""

from deepinfer.parallel.config import ParallelConfig, expert_owner, expert_range
from deepinfer.parallel.eplb import (
    ExpertLoadWindow,
    align_slots,
    imbalance,
    rank_loads,
    rebalance,
    weight_moves,
)
from deepinfer.parallel.placement import (
    ExpertPlacement,
    PlacementTensors,
    initial_placement,
    route_to_slots,
)
from deepinfer.parallel.version import __version__

__all__ = [
    "ExpertLoadWindow",
    "ExpertPlacement",
    "ParallelConfig",
    "PlacementTensors",
    "__version__",
    "align_slots",
    "expert_owner",
    "expert_range",
    "imbalance",
    "initial_placement",
    "rank_loads",
    "rebalance",
    "route_to_slots",
    "weight_moves",
]
