"""deepinfer.parallel: the parallel layout (DP attention, EP experts) as plain data and functions."""

from deepinfer.parallel.context import ParallelConfig, expert_owner, expert_range
from deepinfer.parallel.version import __version__

__all__ = ["ParallelConfig", "__version__", "expert_owner", "expert_range"]
