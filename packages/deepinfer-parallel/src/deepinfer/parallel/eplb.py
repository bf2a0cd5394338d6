"""EPLB: measure per-expert load on the device, replicate hot experts, pack replicas onto ranks.

The policy follows DeepSeek's EPLB (reference-engine spec section 9.4): give each redundant slot
to the logical expert whose extra replica most reduces the load objective, then place every
replica on a rank, heaviest first, on the rank where it raises the objective least, with each
rank holding exactly ``slots_per_rank`` replicas. With a ``[steps, experts]`` load history the
objective is the sum over steps of the maximum load, so per-step bursts count, not only totals.
Everything here is deterministic: ties go to the lower expert id, then the lower rank.
"""

from __future__ import annotations

import torch

from deepinfer.parallel.placement import ExpertPlacement


class ExpertLoadWindow:
    """A device ring of the last ``window`` steps of per-expert routed-token counts.

    ``counts``: ``[window, num_experts]`` int64 on ``device``. :meth:`record` never syncs with
    the host; only the step counter (a host int) advances.
    """

    def __init__(self, num_experts: int, window: int, device: torch.device | str = "cpu") -> None:
        if num_experts < 1 or window < 1:
            raise ValueError(
                f"ExpertLoadWindow: expected num_experts >= 1 and window >= 1, "
                f"got num_experts={num_experts}, window={window}"
            )
        self.num_experts = num_experts
        self.window = window
        self.counts = torch.zeros(window, num_experts, dtype=torch.int64, device=device)
        self.num_steps = 0

    def record(self, topk_ids: torch.Tensor) -> None:
        """Count one step's routing: ``topk_ids`` ``[T, K]`` int64 expert ids in
        ``[0, num_experts)``; negative ids (padding) are not counted. Overwrites the oldest step.
        """
        row = self.counts[self.num_steps % self.window]
        ids = topk_ids.reshape(-1)
        row.zero_()
        row.index_add_(0, ids.clamp(min=0), (ids >= 0).to(torch.int64))
        self.num_steps += 1

    def load(self) -> torch.Tensor:
        """``[window, num_experts]`` int64 counts, oldest step first; steps never recorded are
        zero rows at the end."""
        if self.num_steps < self.window:
            return self.counts.clone()
        start = self.num_steps % self.window
        return torch.cat([self.counts[start:], self.counts[:start]])


def rebalance(
    load: torch.Tensor,
    ep_size: int,
    slots_per_rank: int,
    previous: ExpertPlacement | None = None,
) -> ExpertPlacement:
    """A placement of ``ep_size * slots_per_rank`` replicas balancing ``load``.

    ``load``: ``[num_experts]`` token counts, or ``[steps, num_experts]`` per-step counts (e.g.
    :meth:`ExpertLoadWindow.load`). With ``previous`` given, experts that stay on a rank keep
    their old slot, so :func:`weight_moves` moves only what changed. Runs on the host (copies
    ``load`` there once): call it between steps.
    """
    if load.dim() not in (1, 2) or load.shape[-1] < 1:
        raise ValueError(f"load: expected [E] or [S, E], got shape {tuple(load.shape)}")
    steps = load.detach().to("cpu", torch.float64).reshape(-1, load.shape[-1])
    num_experts = steps.shape[1]
    num_slots = ep_size * slots_per_rank
    if ep_size < 1 or num_slots < num_experts:
        raise ValueError(
            f"slots_per_rank: expected ep_size * slots_per_rank >= {num_experts} experts, "
            f"got ep_size={ep_size}, slots_per_rank={slots_per_rank}"
        )
    counts = _replica_counts(steps, num_slots - num_experts, per_step=load.dim() == 2)
    rows = _pack(steps, counts, ep_size, slots_per_rank)
    placement = ExpertPlacement(num_experts, ep_size, slots_per_rank, rows)
    if previous is not None:
        placement = align_slots(previous, placement)
    return placement


def _replica_counts(steps: torch.Tensor, num_extra: int, per_step: bool) -> list[int]:
    """Replicas per expert: one each, plus ``num_extra`` given greedily to the expert whose
    extra replica most reduces the objective (``steps``: ``[S, E]`` float64)."""
    counts = torch.ones(steps.shape[1], dtype=torch.float64)
    totals = steps.sum(0)
    for _ in range(num_extra):
        gain = totals / (counts * (counts + 1))  # drop of total per-replica load
        if per_step:
            gain = _with_priority(_max_drop(steps, counts), gain)
        counts[int(torch.argmax(gain))] += 1  # argmax takes the first (lowest id) maximum
    return [int(c) for c in counts]


def _max_drop(steps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[E]``: how much sum over steps of the max per-replica load drops if expert e gets one
    more replica."""
    per_replica = steps / counts
    top = per_replica.max(1)
    others = per_replica.clone()
    others[torch.arange(steps.shape[0]), top.indices] = float("-inf")
    second = others.max(1).values
    is_top = torch.zeros_like(per_replica, dtype=torch.bool)
    is_top[torch.arange(steps.shape[0]), top.indices] = True
    rest = torch.where(is_top, second.unsqueeze(1), top.values.unsqueeze(1))
    after = torch.maximum(steps / (counts + 1), rest)
    return (top.values.unsqueeze(1) - after).sum(0)


def _with_priority(primary: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """A score whose argmax is the argmax of ``primary``, ties (to 1e-9 relative) broken by
    ``secondary``."""
    best = primary.max()
    tied = primary >= best - 1e-9 * best.abs().clamp(min=1.0)
    return torch.where(tied, secondary, torch.full_like(secondary, float("-inf")))


def _pack(
    steps: torch.Tensor, counts: list[int], ep_size: int, slots_per_rank: int
) -> tuple[tuple[int, ...], ...]:
    """Longest job first: each replica, heaviest first, goes to the rank with a free slot (and
    no replica of the same expert, when one exists) where it raises the sum over steps of the
    max per-rank load least; ties go to the least loaded rank, then the lowest rank."""
    replicas = [(e, steps[:, e] / c) for e, c in enumerate(counts) for _ in range(c)]
    replicas.sort(key=lambda item: (-float(item[1].sum()), item[0]))
    rank_load = torch.zeros(steps.shape[0], ep_size, dtype=torch.float64)
    peak = torch.zeros(steps.shape[0], dtype=torch.float64)  # max over ranks, per step
    held: list[list[int]] = [[] for _ in range(ep_size)]
    for expert, per_step in replicas:
        free = [r for r in range(ep_size) if len(held[r]) < slots_per_rank]
        candidates = [r for r in free if expert not in held[r]] or free
        raised = torch.maximum(peak.unsqueeze(1), rank_load[:, candidates] + per_step[:, None])
        cost = (raised.sum(0) - peak.sum()).tolist()
        totals = rank_load[:, candidates].sum(0).tolist()
        _, _, rank = min(zip(cost, totals, candidates))
        rank_load[:, rank] += per_step
        peak = torch.maximum(peak, rank_load[:, rank])
        held[rank].append(expert)
    return tuple(tuple(sorted(row)) for row in held)


def align_slots(old: ExpertPlacement, new: ExpertPlacement) -> ExpertPlacement:
    """``new`` with each rank's slots reordered so an expert that stays on a rank keeps its old
    slot; the remaining experts fill the remaining slots in ascending order."""
    _check_same_shape(old, new)
    rows = []
    for old_row, new_row in zip(old.slot_expert, new.slot_expert):
        remaining = sorted(new_row)
        row: list[int | None] = [None] * len(new_row)
        for slot, expert in enumerate(old_row):
            if expert in remaining:
                remaining.remove(expert)
                row[slot] = expert
        fill = iter(remaining)
        rows.append(tuple(e if e is not None else next(fill) for e in row))
    return ExpertPlacement(new.num_experts, new.ep_size, new.slots_per_rank, tuple(rows))


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """``[ep_size]`` float64 tokens each rank receives when each expert's ``load`` (``[E]``) is
    spread evenly over its replicas."""
    if load.shape != (placement.num_experts,):
        raise ValueError(f"load: expected shape [{placement.num_experts}], got {tuple(load.shape)}")
    tables = placement.to_tensors(load.device)
    per_replica = load.to(torch.float64) / tables.num_replicas.to(torch.float64)
    per_slot = per_replica[tables.slot_expert]
    return per_slot.view(placement.ep_size, placement.slots_per_rank).sum(1)


def imbalance(loads: torch.Tensor) -> float:
    """max / mean of per-rank loads (1.0 is perfect balance, also for no load at all). Syncs:
    call it between steps."""
    mean = loads.to(torch.float64).mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def weight_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[tuple[int, int, int, int]]:
    """Copies ``(dst_rank, dst_slot, src_rank, src_slot)`` that turn ``old`` into ``new``.

    Only slots whose expert changes are listed. Sources refer to the OLD placement: read every
    source before writing any destination (or stage through a buffer). A copy already on the
    destination rank is used first; otherwise the lowest global slot holding the expert.
    """
    _check_same_shape(old, new)
    moves = []
    for rank, (old_row, new_row) in enumerate(zip(old.slot_expert, new.slot_expert)):
        for slot, expert in enumerate(new_row):
            if old_row[slot] == expert:
                continue
            if expert in old_row:
                moves.append((rank, slot, rank, old_row.index(expert)))
            else:
                src = old.replicas(expert)[0]
                moves.append((rank, slot, *divmod(src, old.slots_per_rank)))
    return moves


def _check_same_shape(old: ExpertPlacement, new: ExpertPlacement) -> None:
    shape_old = (old.num_experts, old.ep_size, old.slots_per_rank)
    shape_new = (new.num_experts, new.ep_size, new.slots_per_rank)
    if shape_old != shape_new:
        raise ValueError(
            f"placement: expected the same (num_experts, ep_size, slots_per_rank), "
            f"got {shape_old} and {shape_new}"
        )
