"""Which EP rank holds which routed expert in which slot, and how tokens pick a replica.

Each of the ``ep_size`` ranks holds ``slots_per_rank`` expert slots: its share of the logical
experts (``num_experts // ep_size``) plus ``num_redundant`` redundant slots that hold extra
replicas of hot experts (chosen by :mod:`deepinfer.parallel.eplb`). Every slot holds a real
expert. A global slot id is ``rank * slots_per_rank + local_slot``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """The logical expert held by every slot of every EP rank.

    ``slot_expert[rank][local_slot]`` is a logical expert id in ``[0, num_experts)``; every
    logical expert appears in at least one slot.
    """

    num_experts: int
    ep_size: int
    slots_per_rank: int
    slot_expert: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.num_experts < self.ep_size:
            raise ValueError(
                f"ep_size: expected 1 <= ep_size <= num_experts={self.num_experts}, "
                f"got {self.ep_size}"
            )
        if self.slots_per_rank * self.ep_size < self.num_experts:
            raise ValueError(
                f"slots_per_rank: expected >= {-(-self.num_experts // self.ep_size)} to hold "
                f"{self.num_experts} experts on {self.ep_size} ranks, got {self.slots_per_rank}"
            )
        if len(self.slot_expert) != self.ep_size or any(
            len(row) != self.slots_per_rank for row in self.slot_expert
        ):
            raise ValueError(
                f"slot_expert: expected {self.ep_size} rows of {self.slots_per_rank} slots"
            )
        held = {e for row in self.slot_expert for e in row}
        if not held <= set(range(self.num_experts)):
            raise ValueError(f"slot_expert: expected expert ids in [0, {self.num_experts})")
        if len(held) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - held)[:8]
            raise ValueError(f"slot_expert: every expert needs a slot, missing {missing}")

    @property
    def num_redundant(self) -> int:
        """Redundant slots per rank beyond the rank's share of the logical experts."""
        return self.slots_per_rank - self.num_experts // self.ep_size

    @property
    def num_slots(self) -> int:
        return self.ep_size * self.slots_per_rank

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each local slot of ``rank``, in slot order."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.ep_size}, got {rank}")
        return self.slot_expert[rank]

    def replicas(self, expert: int) -> tuple[int, ...]:
        """Global slot ids holding ``expert``, ascending."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert: expected 0 <= expert < {self.num_experts}, got {expert}")
        return tuple(
            rank * self.slots_per_rank + slot
            for rank, row in enumerate(self.slot_expert)
            for slot, e in enumerate(row)
            if e == expert
        )

    def resident_bytes(self, rank: int, bytes_per_expert: int) -> int:
        """Routed-expert weight bytes ``rank`` keeps resident (every slot holds one expert)."""
        return len(self.local_experts(rank)) * bytes_per_expert

    def to_tensors(self, device: torch.device | str = "cpu") -> PlacementTensors:
        """The routing tables as int64 tensors on ``device``."""
        replicas = [self.replicas(e) for e in range(self.num_experts)]
        width = max(len(r) for r in replicas)
        padded = [list(r) + [-1] * (width - len(r)) for r in replicas]
        flat = [e for row in self.slot_expert for e in row]
        return PlacementTensors(
            replica_slots=torch.tensor(padded, dtype=torch.int64, device=device),
            num_replicas=torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=device),
            slot_expert=torch.tensor(flat, dtype=torch.int64, device=device),
        )


@dataclass(frozen=True)
class PlacementTensors:
    """Device-side routing tables of an :class:`ExpertPlacement`.

    ``replica_slots``: ``[num_experts, max_replicas]`` int64, global slot ids, padded with -1.
    ``num_replicas``: ``[num_experts]`` int64, >= 1.
    ``slot_expert``: ``[ep_size * slots_per_rank]`` int64, the logical expert of each global slot.
    """

    replica_slots: torch.Tensor
    num_replicas: torch.Tensor
    slot_expert: torch.Tensor


def initial_placement(num_experts: int, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
    """Rank ``r`` holds the contiguous slice ``[r * n, (r + 1) * n)`` (``n = num_experts //
    ep_size``) in its first ``n`` slots; its ``num_redundant`` extra slots replicate the first
    experts of the next rank (wrapping around), so every slot holds a real expert.
    """
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size: expected a divisor of num_experts={num_experts}, got {ep_size}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant: expected >= 0, got {num_redundant}")
    per_rank = num_experts // ep_size
    rows = []
    for rank in range(ep_size):
        own = range(rank * per_rank, (rank + 1) * per_rank)
        next_start = ((rank + 1) % ep_size) * per_rank
        extra = ((next_start + i) % num_experts for i in range(num_redundant))
        rows.append((*own, *extra))
    return ExpertPlacement(num_experts, ep_size, per_rank + num_redundant, tuple(rows))


def route_to_slots(
    topk_ids: torch.Tensor, tables: PlacementTensors, token_keys: torch.Tensor
) -> torch.Tensor:
    """Map each token's routed logical experts to the global slots that will compute them.

    ``topk_ids``: ``[T, K]`` int64 logical expert ids; ``token_keys``: ``[T]`` int64, >= 0, a key
    of the token alone (e.g. a hash of its request id and position). Among an expert's replicas
    the token takes replica ``token_keys % num_replicas``, so its slot depends only on its own key
    and expert, never on the batch (batch invariant); no host sync.
    Returns ``[T, K]`` int64 global slot ids (``rank * slots_per_rank + local_slot``); a negative
    (padding) expert id gives slot -1.
    """
    if topk_ids.dim() != 2 or token_keys.shape != topk_ids.shape[:1]:
        raise ValueError(
            f"token_keys: expected shape [{topk_ids.shape[0]}] for topk_ids of shape "
            f"{tuple(topk_ids.shape)} ([T, K]), got {tuple(token_keys.shape)}"
        )
    experts = topk_ids.clamp(min=0)
    choice = token_keys.unsqueeze(1) % tables.num_replicas[experts]
    slots = tables.replica_slots[experts, choice]
    return torch.where(topk_ids >= 0, slots, torch.full_like(slots, -1))
