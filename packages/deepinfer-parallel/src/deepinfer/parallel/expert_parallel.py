"""The expert-parallel context a model is built with, and the transport that moves expert
weights between ranks when EPLB changes the placement.

A model built with an :class:`ExpertParallelContext` holds only its rank's expert slots and
sends tokens to the ranks of their experts; built with ``None`` it is one process holding every
expert. :func:`move_slots` is the collective copy of a rebalance: each rank sends the slots other
ranks now need in one variable-split all-to-all, so no rank ever holds more than its own slots
plus what it sends and receives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.parallel.comm import Communicator
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.eplb import weight_moves
from deepinfer.parallel.placement import ExpertPlacement, initial_placement


@dataclass(frozen=True)
class ExpertParallelContext:
    """The EP group of this process and how its MoE layers place experts.

    ``num_redundant_experts``: extra slots per rank (replicas of hot experts);
    ``eplb_window``: steps of per-expert load each MoE layer keeps on the device for EPLB
    (0: no load is recorded).
    """

    comm: Communicator
    num_redundant_experts: int = 0
    eplb_window: int = 0

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"num_redundant_experts: expected >= 0, got {self.num_redundant_experts}"
            )
        if self.eplb_window < 0:
            raise ValueError(f"eplb_window: expected >= 0, got {self.eplb_window}")

    @classmethod
    def from_config(cls, config: ParallelConfig, comm: Communicator) -> ExpertParallelContext:
        """The context of ``config``'s EP layout over ``comm`` (its world is the EP group)."""
        if comm.world_size != config.ep_size:
            raise ValueError(
                f"comm: expected a group of expert_parallel_size={config.ep_size} ranks, "
                f"got {comm.world_size}"
            )
        window = config.eplb_window if config.is_eplb_enabled else 0
        return cls(comm, config.num_redundant_experts, window)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def placement(self, num_experts: int) -> ExpertPlacement:
        """The starting placement of a layer of ``num_experts`` routed experts."""
        if num_experts % self.world_size:
            raise ValueError(
                f"expert_parallel_size={self.world_size}: expected a divisor of the layer's "
                f"{num_experts} routed experts"
            )
        return initial_placement(num_experts, self.world_size, self.num_redundant_experts)


def move_slots(
    old: ExpertPlacement,
    new: ExpertPlacement,
    read_slot: Callable[[int], torch.Tensor],
    row_bytes: int,
    comm: Communicator,
    device: torch.device | str = "cpu",
) -> dict[int, torch.Tensor]:
    """The new content of every local slot whose expert changes from ``old`` to ``new``.

    ``read_slot(local_slot)`` gives a slot's weights under ``old`` as one ``[row_bytes]`` uint8
    row (every expert of a layer packs to the same size). Every rank calls this with the same
    placements; the moves are the same everywhere, so when nothing crosses ranks no collective
    runs on any rank. Returns ``{local_slot: [row_bytes] uint8}`` (copies, safe to write after
    every read).
    """
    me, moves = comm.rank, weight_moves(old, new)
    out = {dst: read_slot(src).clone() for d, dst, s, src in moves if d == me and s == me}
    if all(d == s for d, _, s, _ in moves):
        return out
    sends = sorted((d, dst, src) for d, dst, s, src in moves if s == me and d != me)
    recvs = sorted((s, dst) for d, dst, s, _ in moves if d == me and s != me)
    send_splits = [sum(1 for d, _, _ in sends if d == r) for r in range(comm.world_size)]
    recv_splits = [sum(1 for s, _ in recvs if s == r) for r in range(comm.world_size)]
    if sends:
        send = torch.stack([_row(read_slot(src), row_bytes) for _, _, src in sends])
    else:
        send = torch.empty((0, row_bytes), dtype=torch.uint8, device=device)
    received = send.new_empty((len(recvs), row_bytes))
    comm.all_to_all_single(received, send, recv_splits, send_splits)
    out.update({dst: received[i] for i, (_, dst) in enumerate(recvs)})
    return out


def _row(row: torch.Tensor, row_bytes: int) -> torch.Tensor:
    if row.dtype != torch.uint8 or tuple(row.shape) != (row_bytes,):
        raise ValueError(
            f"read_slot: expected a [{row_bytes}] uint8 row, got {tuple(row.shape)} {row.dtype}"
        )
    return row
