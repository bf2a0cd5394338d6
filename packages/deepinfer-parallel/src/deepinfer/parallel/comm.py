"""The communication interface the parallel code talks to, and its implementations.

:class:`Communicator` is the few collectives MoE expert parallelism and attention DP need, so a
faster implementation (symmetric memory, DeepEP-style kernels) can replace the
``torch.distributed`` one without touching its callers. :class:`TorchDistributedComm` wraps a
``torch.distributed`` process group: NCCL on NVIDIA, gloo on CPU (gloo implements every call
here, variable-split ``all_to_all_single`` and ``all_gather_into_tensor`` included, for CPU
tensors of any dtype we use), HCCL left to its own backend name. :class:`SingleProcessComm` is
the world of one (EP = 1): every collective is a copy or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

ReduceOpName = Literal["sum", "max", "min", "product"]


@runtime_checkable
class Communicator(Protocol):
    """Collectives over ``world_size`` ranks; every rank calls each one in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
    ) -> None:
        """Rank ``i`` sends rows ``input[split i of input_split_sizes]`` to each rank, in rank order.

        ``output`` receives from each rank ``j`` its ``output_split_sizes[j]`` rows, stacked in
        rank order along dim 0. Sizes are host integers (``None``: equal splits).
        """
        ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` [world_size * N, ...] = every rank's ``input`` [N, ...], in rank order."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> None:
        """Reduce ``tensor`` in place over all ranks."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...


def _check_splits(name: str, splits: Sequence[int] | None, rows: int, world_size: int) -> None:
    if splits is None:
        if rows % world_size:
            raise ValueError(f"{name}: None needs rows={rows} divisible by {world_size}")
        return
    if len(splits) != world_size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            f"{name}: expected {world_size} non-negative sizes summing to {rows}, got {list(splits)}"
        )


class TorchDistributedComm:
    """:class:`Communicator` over a ``torch.distributed`` group (``None``: the default group)."""

    _OPS = {
        "sum": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedComm: torch.distributed is not initialised")
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None):
        _check_splits("input_split_sizes", input_split_sizes, input.shape[0], self._world_size)
        _check_splits("output_split_sizes", output_split_sizes, output.shape[0], self._world_size)
        dist.all_to_all_single(
            output,
            input.contiguous(),
            None if output_split_sizes is None else list(output_split_sizes),
            None if input_split_sizes is None else list(input_split_sizes),
            group=self.group,
        )

    def all_gather_into_tensor(self, output, input):
        if output.shape[0] != input.shape[0] * self._world_size:
            raise ValueError(
                f"output: expected {input.shape[0] * self._world_size} rows "
                f"(world_size x input rows), got {output.shape[0]}"
            )
        dist.all_gather_into_tensor(output, input.contiguous(), group=self.group)

    def all_reduce(self, tensor, op="sum"):
        if op not in self._OPS:
            raise ValueError(f"op: expected one of {sorted(self._OPS)}, got {op!r}")
        dist.all_reduce(tensor, op=self._OPS[op], group=self.group)

    def barrier(self):
        dist.barrier(group=self.group)


class SingleProcessComm:
    """:class:`Communicator` of a world of one rank: sends go to itself."""

    rank = 0
    world_size = 1

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None):
        _check_splits("input_split_sizes", input_split_sizes, input.shape[0], 1)
        _check_splits("output_split_sizes", output_split_sizes, output.shape[0], 1)
        if output.shape != input.shape:
            raise ValueError(f"output: expected shape {tuple(input.shape)}, got {output.shape}")
        output.copy_(input)

    def all_gather_into_tensor(self, output, input):
        if output.shape != input.shape:
            raise ValueError(f"output: expected shape {tuple(input.shape)}, got {output.shape}")
        output.copy_(input)

    def all_reduce(self, tensor, op="sum"):
        if op not in TorchDistributedComm._OPS:
            raise ValueError(f"op: expected one of {sorted(TorchDistributedComm._OPS)}, got {op!r}")

    def barrier(self):
        pass
