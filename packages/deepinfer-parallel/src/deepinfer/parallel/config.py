"""The parallel layout of one engine instance, passed explicitly to whoever needs it.

Attention is data parallel (each DP rank owns its requests and cache) and the MoE is expert
parallel across the same ranks (DESIGN.md section 10), so ``expert_parallel_size`` is either
``data_parallel_size`` (experts sharded over the DP ranks) or 1 (every rank holds every expert),
and ``world_size == data_parallel_size``. This module holds the pure arithmetic of that layout;
process groups are formed by the communication layer when the workers start.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.parallel.context import check_context_parallel


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run attention DP and MoE EP, how many of them prefill one long prompt
    together (``context_parallel_size``, a divisor of the DP ranks), and how EPLB rebalances
    the experts.

    ``num_redundant_experts`` is the number of extra expert slots on EACH EP rank (replicas of hot
    experts chosen by EPLB); ``eplb_interval`` is the number of steps between rebalances (0 turns
    EPLB off) and ``eplb_window`` the number of steps of per-expert load history it looks at.
    """

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 100
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_at_least("data_parallel_size", self.data_parallel_size, 1)
        _check_at_least("expert_parallel_size", self.expert_parallel_size, 1)
        _check_at_least("num_redundant_experts", self.num_redundant_experts, 0)
        _check_at_least("eplb_interval", self.eplb_interval, 0)
        _check_at_least("eplb_window", self.eplb_window, 1)
        if self.expert_parallel_size not in (1, self.data_parallel_size):
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size}: expected 1 (replicated "
                f"experts) or data_parallel_size={self.data_parallel_size} (attention DP spans "
                "the EP ranks)"
            )
        check_context_parallel(self.context_parallel_size, self.data_parallel_size)

    @property
    def world_size(self) -> int:
        """Number of ranks (processes, one device each)."""
        return self.data_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_parallel_size

    @property
    def dp_size(self) -> int:
        return self.data_parallel_size

    @property
    def is_eplb_enabled(self) -> bool:
        return self.eplb_interval > 0

    def slots_per_rank(self, num_experts: int) -> int:
        """Expert slots each EP rank holds: its share of the logical experts plus redundant slots."""
        return num_experts // self.expert_parallel_size + self.num_redundant_experts

    def validate_for(self, num_experts: int, num_devices: int) -> None:
        """Raise one clear ``ValueError`` line if this layout cannot run this model on these devices.

        ``num_experts`` is the model's routed (logical) expert count; ``num_devices`` the devices
        (or CPU processes) available to this engine.
        """
        _check_at_least("num_experts", num_experts, 1)
        if num_experts % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size}: expected a divisor of the "
                f"model's {num_experts} routed experts"
            )
        if num_devices < self.world_size:
            raise ValueError(
                f"world_size={self.world_size} (data_parallel_size={self.data_parallel_size}, "
                f"expert_parallel_size={self.expert_parallel_size}) needs {self.world_size} "
                f"devices, found {num_devices}"
            )


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


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
