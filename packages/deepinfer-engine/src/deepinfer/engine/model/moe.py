"""Mixture of experts: score routing (sqrt-softplus, bias for selection only) or hash routing
(``tid2eid``), routed experts and one shared expert, each a clamped SwiGLU.

The routed experts run one of two ways. The host loop over the experts a step routes to (one
:class:`Expert` call each) is the reference path, and the only one for dense or FP8 experts.
FP4 experts on a GPU go through the one grouped op :func:`deepinfer.kernels.fp4_moe_experts`
instead: right after loading (:func:`stack_grouped_experts`, or else on first use) the experts'
packed weights are moved into stacked ``[E, ...]`` tensors and each expert's parameters become
views of them, so loading, ``state_dict`` and memory stay as they were. The two paths round the
same values; they differ only in the fp32 order in which a token's experts are summed (slot
order in the op, expert order in the loop) and in the op keeping the gate/up outputs in fp32
before the SwiGLU.

Built with an :class:`~deepinfer.parallel.ExpertParallelContext`, the layer holds only its
rank's experts and runs them across the EP group (:mod:`.expert_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.expert_parallel import (
    ExpertSlots,
    build_local_experts,
    expert_parallel_idle,
    expert_parallel_routed,
    token_keys,
)
from deepinfer.engine.model.layers import LinearFactory, project
from deepinfer.engine.model.variant import variant_of
from deepinfer.parallel import ExpertParallelContext


class Gate(nn.Module):
    """Router: ``weight [E, D]``; ``bias [E]`` fp32 (score layers) or ``tid2eid [vocab, k]``
    int64 (hash layers); V4.1 also ``bias_vl`` (the selection bias of image-span tokens)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, factory: LinearFactory, n_experts: int, top_k: int
    ) -> None:
        super().__init__()
        c, dev, variant = config, factory.device, variant_of(config)
        self.top_k, self.is_hash = top_k, c.is_hash_layer(layer_id)
        self.scoring_func, self.route_scale = c.scoring_func, c.routed_scaling_factor
        self.renormalize = c.norm_topk_prob and top_k > 1
        self.norm_eps = variant.router_norm_eps
        self.temperature = c.gate_temp if variant.router_temperature else 1.0
        self.weight = nn.Parameter(
            torch.empty(n_experts, c.hidden_size, dtype=factory.dtype, device=dev),
            requires_grad=False,
        )
        if self.is_hash:
            tid2eid = torch.zeros(c.vocab_size, top_k, dtype=torch.int64, device=dev)
            self.tid2eid = nn.Parameter(tid2eid, requires_grad=False)
        else:
            bias = torch.empty(n_experts, dtype=torch.float32, device=dev)
            self.bias = nn.Parameter(bias, requires_grad=False)
            if variant.router_image_bias:
                self.bias_vl = nn.Parameter(bias.clone(), requires_grad=False)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64).
        ``image_mask`` ``[T]`` bool: V4.1 image-span rows, which select with ``bias_vl``."""
        logits = K.linear(x.float(), self.weight, out_dtype=torch.float32)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        kw = dict(
            scoring_func=self.scoring_func,
            route_scale=self.route_scale,
            norm_eps=self.norm_eps,
            renormalize=self.renormalize,
        )
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
            return K.route_hash(logits, ids, **kw), ids
        weights, ids = K.route_topk(logits, self.bias, self.top_k, **kw)
        if image_mask is None or not hasattr(self, "bias_vl"):
            return weights, ids
        vl_weights, vl_ids = K.route_topk(logits, self.bias_vl, self.top_k, **kw)
        image = image_mask[:, None]
        return torch.where(image, vl_weights, weights), torch.where(image, vl_ids, ids)


class Expert(nn.Module):
    """``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L) * route_weight)``."""

    def __init__(self, dim: int, inter: int, limit: float, make) -> None:
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = make(dim, inter), make(inter, dim), make(dim, inter)

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = project(x, self.w1, self.w3)
        if route_weight is None:  # rounded to x.dtype in the op: no cast launch
            return self.w2(K.swiglu_clamped(gate, up, self.limit, out_dtype=x.dtype))
        hidden = K.swiglu_clamped(gate, up, self.limit) * route_weight.unsqueeze(-1)
        return self.w2(hidden.to(x.dtype))


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        factory: LinearFactory,
        n_experts: int | None = None,
        top_k: int | None = None,
        expert_parallel: ExpertParallelContext | None = None,
    ) -> None:
        super().__init__()
        c = config
        n_experts = n_experts or c.n_routed_experts
        top_k = top_k or c.num_experts_per_tok
        self.gate = Gate(c, layer_id, factory, n_experts, top_k)
        dim, inter, limit = c.hidden_size, c.moe_intermediate_size, c.swiglu_limit
        self.make_expert = lambda: Expert(dim, inter, limit, factory.expert)
        # None: one process holds every expert; else this rank's slots (keyed by expert id)
        self.ep = None
        if expert_parallel is None:
            self.experts = nn.ModuleList(self.make_expert() for _ in range(n_experts))
        else:
            self.ep = ExpertSlots(expert_parallel, n_experts, factory.device)
            self.experts = build_local_experts(self.ep, self.make_expert)
        self.shared_experts = Expert(dim, inter * c.n_shared_experts, limit, factory.quantised)
        self.swiglu_limit = limit
        # None: the grouped op for FP4 experts on a GPU, the loop elsewhere; True/False force it
        self.grouped_experts: bool | None = None
        self._stacked: tuple[torch.Tensor, ...] | None = None

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``: routed experts summed in fp32, plus the shared expert.
        ``positions`` ``[T]`` only spread an expert's tokens over its replicas under EP;
        ``image_mask`` ``[T]`` marks V4.1 image-span rows (routed with ``gate.bias_vl``)."""
        if self.ep is not None and x.shape[0] == 0:
            return expert_parallel_idle(self, x)  # no tokens here: serve the other ranks'
        weights, ids = self.gate(x, input_ids, image_mask)
        if self.ep is not None:
            keys = token_keys(input_ids, positions)
            routed = expert_parallel_routed(self, x, weights, ids, keys)
        elif self.uses_grouped_experts(x.device):
            routed = self._grouped(x, weights, ids)
        else:
            routed = self._looped(x, weights, ids)
        # routed: a fresh fp32 sum; adding the shared expert's bf16 rows in place widens them
        # exactly, as a separate cast would
        return routed.add_(self.shared_experts(x)).to(x.dtype)

    def expert_list(self) -> list[Expert]:
        """The routed experts by slot: expert id order, or under EP this rank's slots."""
        if self.ep is None:
            return list(self.experts)
        return [self.experts[str(e)] for e in self.ep.slot_experts]

    def drop_stacked_experts(self) -> None:
        """Forget the grouped op's stack (the experts changed); rebuilt on next use."""
        self._stacked = None

    def uses_grouped_experts(self, device: torch.device) -> bool:
        """Whether the routed experts run as one grouped op on ``device`` (FP4 experts only)."""
        fmt = self._first_expert().w1.fmt
        if fmt != "fp4":
            if self.grouped_experts:
                raise ValueError(f"MoE.grouped_experts=True needs FP4 experts, got {fmt!r}")
            return False
        if self.grouped_experts is not None:
            return self.grouped_experts
        return device.type == "cuda"

    def _first_expert(self) -> Expert:
        return self.experts[0] if self.ep is None else self.expert_list()[0]

    def _looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert_id in torch.unique(ids).tolist():  # reference path: host loop over experts
            tokens, slots = (ids == expert_id).nonzero(as_tuple=True)
            routed = self.experts[expert_id](x[tokens], weights[tokens, slots])
            out.index_add_(0, tokens, routed.float())
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w13_scale, w2, w2_scale = self.stacked_experts()
        return K.fp4_moe_experts(
            x,
            weights,
            ids,
            w13,
            w13_scale,
            w2,
            w2_scale,
            swiglu_limit=self.swiglu_limit,
            act_quant_group=self.experts[0].w1.act_quant_group,
        )

    @torch.no_grad()
    def stacked_experts(self) -> tuple[torch.Tensor, ...]:
        """``(w13 [E, 2I, D/2], w13_scale [E, 2I, D/32], w2 [E, D, I/2], w2_scale [E, D, I/32])``.

        Built once: the experts' tensors are copied into the stack and each expert's parameters
        then point into it (rows ``0..I-1`` of ``w13`` are ``w1``, ``I..2I-1`` are ``w3``), so
        later in-place loads still reach the stack. Rebuilt when the first expert's parameter no
        longer points into it (the model was moved or its parameters reassigned).
        """
        first = self._first_expert().w1.weight
        if self._stacked is not None and first.data_ptr() == self._stacked[0].data_ptr():
            return self._stacked
        experts = self.expert_list()
        inter = experts[0].w1.out_features
        views = {  # stack name -> per expert: (parameter holder, attribute, row slice)
            "w13": [(e.w1, "weight", slice(0, inter)) for e in experts]
            + [(e.w3, "weight", slice(inter, None)) for e in experts],
            "w13_scale": [(e.w1, "scale", slice(0, inter)) for e in experts]
            + [(e.w3, "scale", slice(inter, None)) for e in experts],
            "w2": [(e.w2, "weight", slice(None)) for e in experts],
            "w2_scale": [(e.w2, "scale", slice(None)) for e in experts],
        }
        stacks = {}
        for name, targets in views.items():
            linear, attr, _ = targets[0]
            rows = 2 * inter if name.startswith("w13") else linear.out_features
            like = getattr(linear, attr)
            stack = like.new_empty((len(experts), rows, like.shape[1]))
            pointed = set()  # an expert in two EP slots points into its first one
            for index, (linear, attr, rows_slice) in enumerate(targets):
                view = stack[index % len(experts), rows_slice]
                param = getattr(linear, attr)
                view.copy_(param)
                if id(param) not in pointed:
                    pointed.add(id(param))
                    param.data = view  # the expert's own storage is freed here
            stacks[name] = stack
        self._stacked = (stacks["w13"], stacks["w13_scale"], stacks["w2"], stacks["w2_scale"])
        return self._stacked


def stack_grouped_experts(model: nn.Module, device: torch.device) -> int:
    """Stack the experts of every MoE layer that runs the grouped op on ``device``, now (right
    after loading, before the cache takes the free memory) rather than on first use; returns
    how many layers were stacked."""
    stacked = 0
    for module in model.modules():
        if isinstance(module, MoE) and module.uses_grouped_experts(device):
            module.stacked_experts()
            stacked += 1
    return stacked
