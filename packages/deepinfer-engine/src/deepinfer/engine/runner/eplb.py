"""EPLB in the engine: every ``interval`` steps, between steps, re-place each expert-parallel
layer's experts by the load of its last window of steps and move their weights.

Each MoE layer counts its routed tokens per expert on the device every forward
(:class:`~deepinfer.parallel.ExpertLoadWindow`, no host sync). A rebalance sums the windows over
the EP group (one all-reduce for all layers), so every rank computes the same placement
(:func:`~deepinfer.parallel.rebalance`, deterministic), then moves each layer's changed slots
with one all-to-all (:func:`~deepinfer.engine.model.expert_parallel.apply_placement`). Every
rank calls :meth:`EplbController.after_step` after every step, idle ranks too.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepinfer.engine.model.expert_parallel import apply_placement, expert_parallel_layers
from deepinfer.parallel import imbalance, rank_loads, rebalance

logger = logging.getLogger("deepinfer.engine")


class EplbController:
    """Rebalances ``model``'s expert-parallel layers every ``interval`` steps."""

    def __init__(self, model: nn.Module, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"eplb_interval: expected >= 1, got {interval}")
        self.layers = expert_parallel_layers(model)
        missing = [i for i, m in enumerate(self.layers) if m.ep.window is None]
        if not self.layers or missing:
            raise ValueError(
                "EplbController: expected expert-parallel MoE layers built with eplb_window > 0 "
                f"(layers without a load window: {missing or 'no EP layers'})"
            )
        self.interval = interval
        self.num_steps = 0
        self.num_rebalances = 0

    def after_step(self) -> bool:
        """Count a step; every ``interval`` steps rebalance. Returns whether it rebalanced."""
        self.num_steps += 1
        if self.num_steps % self.interval:
            return False
        self.rebalance()
        return True

    @torch.no_grad()
    def rebalance(self) -> int:
        """Re-place every layer now (every rank at once); returns experts moved to this rank."""
        comm = self.layers[0].ep.ctx.comm
        loads = torch.stack([m.ep.window.load() for m in self.layers])  # [L, W, E]
        comm.all_reduce(loads)
        moved, before, after = 0, [], []
        for moe, load in zip(self.layers, loads):
            old = moe.ep.placement
            new = rebalance(load, old.ep_size, old.slots_per_rank, previous=old)
            before.append(imbalance(rank_loads(load.sum(0), old)))
            after.append(imbalance(rank_loads(load.sum(0), new)))
            moved += apply_placement(moe, new)
        self.num_rebalances += 1
        logger.info(
            "EPLB rebalance %d: max/mean rank load %.3f -> %.3f (worst layer), %d experts arrived",
            self.num_rebalances,
            max(before),
            max(after),
            moved,
        )
        return moved
