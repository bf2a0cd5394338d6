"""Mixture of experts: score routing (sqrt-softplus, bias for selection only) or hash routing
(``tid2eid``), routed experts and one shared expert, each a clamped SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.layers import LinearFactory


class Gate(nn.Module):
    """Router: ``weight [E, D]``; ``bias [E]`` fp32 (score layers) or ``tid2eid [vocab, k]``
    int64 (hash layers); V4.1 also ``bias_vl`` (image tokens, unused by text-only inference)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, factory: LinearFactory, n_experts: int, top_k: int
    ) -> None:
        super().__init__()
        c, dev = config, factory.device
        self.top_k, self.is_hash = top_k, c.is_hash_layer(layer_id)
        self.scoring_func, self.route_scale = c.scoring_func, c.routed_scaling_factor
        self.renormalize = c.norm_topk_prob and top_k > 1
        self.norm_eps = 1e-20 if c.is_v41 else 0.0
        self.temperature = c.gate_temp if c.is_v41 else 1.0
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
            if c.is_v41:
                self.bias_vl = nn.Parameter(bias.clone(), requires_grad=False)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64)."""
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
        return K.route_topk(logits, self.bias, self.top_k, **kw)


class Expert(nn.Module):
    """``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L) * route_weight)``."""

    def __init__(self, dim: int, inter: int, limit: float, make) -> None:
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = make(dim, inter), make(inter, dim), make(dim, inter)

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None) -> torch.Tensor:
        hidden = K.swiglu_clamped(self.w1(x), self.w3(x), self.limit)
        if route_weight is not None:
            hidden = hidden * route_weight.unsqueeze(-1)
        return self.w2(hidden.to(x.dtype))


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        factory: LinearFactory,
        n_experts: int | None = None,
        top_k: int | None = None,
    ) -> None:
        super().__init__()
        c = config
        n_experts = n_experts or c.n_routed_experts
        top_k = top_k or c.num_experts_per_tok
        self.gate = Gate(c, layer_id, factory, n_experts, top_k)
        dim, inter, limit = c.hidden_size, c.moe_intermediate_size, c.swiglu_limit
        self.experts = nn.ModuleList(
            Expert(dim, inter, limit, factory.expert) for _ in range(n_experts)
        )
        self.shared_experts = Expert(dim, inter * c.n_shared_experts, limit, factory.quantised)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``: routed experts summed in fp32, plus the shared expert."""
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert_id in torch.unique(ids).tolist():  # reference path: host loop over experts
            tokens, slots = (ids == expert_id).nonzero(as_tuple=True)
            routed = self.experts[expert_id](x[tokens], weights[tokens, slots])
            out.index_add_(0, tokens, routed.float())
        return (out + self.shared_experts(x).float()).to(x.dtype)
