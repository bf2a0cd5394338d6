"""The parallel layout of one engine instance, passed explicitly to whoever needs it.

Attention is data parallel (each DP rank owns its requests and cache) and the MoE is expert
parallel across all ranks (DESIGN.md section 10). This module holds the pure arithmetic of that
layout; process groups are attached by the engine when it starts its workers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """``world_size`` ranks; attention DP over ``dp_size`` of them, experts spread over all."""

    world_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        if self.dp_size < 1 or self.world_size % self.dp_size:
            raise ValueError(
                f"dp_size: expected a divisor of world_size={self.world_size}, got {self.dp_size}"
            )

    @property
    def ep_size(self) -> int:
        return self.world_size


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The routed experts rank ``ep_rank`` holds: a contiguous, balanced slice.

    With ``num_experts % ep_size == r``, the first ``r`` ranks hold one expert more.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank: expected 0 <= ep_rank < ep_size={ep_size}, got {ep_rank}")
    if num_experts < ep_size:
        raise ValueError(f"num_experts={num_experts} is smaller than ep_size={ep_size}")
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def expert_owner(expert: int, num_experts: int, ep_size: int) -> int:
    """The EP rank that holds routed expert ``expert`` (inverse of :func:`expert_range`)."""
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert: expected 0 <= expert < {num_experts}, got {expert}")
    base, extra = divmod(num_experts, ep_size)
    boundary = extra * (base + 1)
    if expert < boundary:
        return expert // (base + 1)
    return extra + (expert - boundary) // base
