"""Expert parallelism of the MoE layers: each rank holds its placement's expert slots, tokens
travel to the ranks of their experts and come back, and EPLB can change the placement between
steps.

A MoE layer built with an :class:`~deepinfer.parallel.ExpertParallelContext` keeps its
experts in a ``ModuleDict`` keyed by logical expert id, holding only the experts of its rank's
slots, so the ``state_dict`` names are the checkpoint's and the loader fills exactly those
(:func:`held_elsewhere`). Its forward (:func:`expert_parallel_routed`) routes as the
single-process layer does, maps each (token, expert) pair to a slot, dispatches rows with their
router weights, runs each local slot on its rows, and combines in a fixed order: a token's
experts are summed in ascending expert id in fp32 (the single-process loop's order; the grouped
op's slot order on a GPU), so with batch-invariant kernels a token's output is bitwise the
single-process one, whatever other ranks run. A rank with no tokens still takes part in every
collective (:func:`idle_step`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.parallel import (
    ExpertLoadWindow,
    ExpertParallelContext,
    ExpertPlacement,
    combine,
    dispatch,
    dispatch_pairs,
    group_by_slot,
    move_slots,
    route_to_slots,
)

# A token's replica choice among an expert's copies: a key of the token alone (its position and
# id), so the choice never depends on the batch.
_POSITION_STRIDE = 1_000_003


class ExpertSlots:
    """One MoE layer's share of the experts: its placement, the device routing tables and,
    with EPLB, the window of per-expert load."""

    def __init__(
        self, ctx: ExpertParallelContext, num_experts: int, device: torch.device | str | None
    ) -> None:
        self.ctx = ctx
        self.device = torch.device("cpu" if device in (None, "meta") else device)
        self.num_forwards = 0  # forwards run, idle ones included (the executor's step check)
        self.window = None
        if ctx.eplb_window:
            self.window = ExpertLoadWindow(num_experts, ctx.eplb_window, self.device)
        self.set_placement(ctx.placement(num_experts))

    def set_placement(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        self.tables = placement.to_tensors(self.device)

    def follow(self, device: torch.device) -> None:
        """Keep the tables and the load window on ``device`` (the model was moved)."""
        if device != self.device:
            self.device = device
            self.set_placement(self.placement)
            if self.window is not None:
                self.window.counts = self.window.counts.to(device)

    @property
    def slot_experts(self) -> tuple[int, ...]:
        """The logical expert of each local slot, in slot order."""
        return self.placement.local_experts(self.ctx.rank)

    @property
    def held(self) -> list[int]:
        """The distinct logical experts this rank holds, ascending."""
        return sorted(set(self.slot_experts))


def build_local_experts(slots: ExpertSlots, make_expert: Callable[[], nn.Module]) -> nn.ModuleDict:
    """The experts of this rank's slots, keyed by logical expert id (checkpoint names)."""
    return nn.ModuleDict({str(e): make_expert() for e in slots.held})


def expert_parallel_routed(
    moe: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """Routed experts of ``x`` ``[T, D]`` across the EP group -> ``[T, D]`` fp32.

    ``weights`` / ``ids`` ``[T, k]``: the gate's routing; ``keys`` ``[T]`` int64 >= 0 pick a
    replica when an expert has several.
    """
    slots: ExpertSlots = moe.ep
    comm, per_rank = slots.ctx.comm, slots.placement.slots_per_rank
    grouped = moe.uses_grouped_experts(x.device)
    slots.num_forwards += 1
    slots.follow(x.device)
    if not grouped:  # the single-process loop adds a token's experts in ascending id
        ids, perm = ids.sort(dim=1)
        weights = weights.gather(1, perm)
    if slots.window is not None:
        slots.window.record(ids)
    global_slot = route_to_slots(ids, slots.tables, keys)
    received, local_slot, handle = dispatch(x, global_slot, per_rank, comm)
    route_weight = dispatch_pairs(weights, handle, comm)
    # expert outputs travel back in the activation dtype: each is already rounded to it (the
    # loop's experts return it, the grouped op rounds each slot's output to bf16), so the fp32
    # sum below is the single-process one
    if grouped and received.shape[0] == 0:
        out = received.new_empty(received.shape)
    elif grouped:
        w13, w13_scale, w2, w2_scale = moe.stacked_experts()
        out = K.fp4_moe_experts(
            received,
            route_weight[:, None],
            local_slot[:, None],
            w13,
            w13_scale,
            w2,
            w2_scale,
            swiglu_limit=moe.swiglu_limit,
            act_quant_group=moe.expert_list()[0].w1.act_quant_group,
        ).to(received.dtype)
    else:
        out = _run_slots(moe.expert_list(), received, route_weight, local_slot, per_rank)
    # router weights were applied inside the experts: combine only sums, in k order
    return combine(out, torch.ones_like(weights), handle, comm, out_dtype=torch.float32)


def expert_parallel_idle(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A step with no tokens on this rank (``x`` ``[0, D]``): no gate, no shared expert (empty
    launches), but the collectives run and this rank's experts serve the rows it receives."""
    top_k = moe.gate.top_k
    ids = torch.empty((0, top_k), dtype=torch.long, device=x.device)
    weights = torch.empty((0, top_k), dtype=torch.float32, device=x.device)
    keys = torch.empty(0, dtype=torch.long, device=x.device)
    expert_parallel_routed(moe, x, weights, ids, keys)
    return x.new_empty(x.shape)


def _run_slots(experts, received, route_weight, local_slot, per_rank) -> torch.Tensor:
    out = received.new_zeros(received.shape)
    order, counts = group_by_slot(local_slot, per_rank)
    for slot, rows in enumerate(order.split(counts.tolist())):
        if rows.numel():
            out[rows] = experts[slot](received[rows], route_weight[rows])
    return out


def token_keys(input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``[T]`` int64 >= 0 from the token alone: its id and, when known, its position."""
    keys = input_ids.long()
    if positions is not None and positions.shape == input_ids.shape:
        keys = keys + positions.long() * _POSITION_STRIDE
    return keys


def expert_parallel_layers(model: nn.Module) -> list[nn.Module]:
    """The expert-parallel MoE layers of ``model``, in forward order."""
    return [m for m in model.modules() if getattr(m, "ep", None) is not None]


@torch.no_grad()
def idle_step(model: nn.Module) -> None:
    """A step with no tokens on this rank: every expert-parallel layer, in forward order, takes
    part in its collectives with zero rows (so the other ranks' step can finish)."""
    for moe in expert_parallel_layers(model):
        weight = moe.gate.weight
        x = torch.empty((0, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        moe(x, torch.empty(0, dtype=torch.long, device=weight.device))


_EXPERT_NAME = re.compile(r"^(.*)\.experts\.(\d+)\.")


def held_elsewhere(model: nn.Module) -> Callable[[str], bool] | None:
    """For the loader: whether a checkpoint tensor belongs to a routed expert another EP rank
    holds (None when the model is not expert parallel)."""
    held = {name: set(m.ep.held) for name, m in model.named_modules() if getattr(m, "ep", None)}
    if not held:
        return None

    def predicate(tensor_name: str) -> bool:
        match = _EXPERT_NAME.match(tensor_name)
        if match is None or match.group(1) not in held:
            return False
        return int(match.group(2)) not in held[match.group(1)]

    return predicate


def _pack(expert: nn.Module) -> torch.Tensor:
    """All of an expert's tensors as one uint8 row (``state_dict`` order)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in expert.state_dict().values()])


def _unpack(row: torch.Tensor, expert: nn.Module) -> None:
    offset = 0
    for t in expert.state_dict().values():
        size = t.numel() * t.element_size()
        t.copy_(row[offset : offset + size].clone().view(t.dtype).view(t.shape))
        offset += size


@torch.no_grad()
def apply_placement(moe: nn.Module, new: ExpertPlacement) -> int:
    """Move ``moe`` to placement ``new`` with collective copies (every rank calls it, between
    steps); returns how many experts arrived on this rank."""
    slots: ExpertSlots = moe.ep
    old, old_experts = slots.placement, moe.expert_list()
    row_bytes = _pack(old_experts[0]).numel()
    arrived = move_slots(
        old,
        new,
        lambda slot: _pack(old_experts[slot]),
        row_bytes,
        slots.ctx.comm,
        slots.device,
    )
    kept = {int(e): m for e, m in moe.experts.items()}
    new_row = new.local_experts(slots.ctx.rank)
    modules, received = {}, 0
    for slot, expert in enumerate(new_row):
        if expert in modules:
            continue
        if expert in kept:
            modules[expert] = kept[expert]
        else:
            modules[expert] = moe.make_expert()
            _unpack(arrived[slot], modules[expert])
            received += 1
    moe.experts = nn.ModuleDict({str(e): modules[e] for e in sorted(modules)})
    slots.set_placement(new)
    moe.drop_stacked_experts()
    return received
