"""Lightning indexer (V4 CSA layers): scores compressed entries per query, keeps the top k."""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.compressor import Compressor
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.engine.model.metadata import CompressionPlan
from deepinfer.engine.model.variant import variant_of


class Indexer(nn.Module):
    """Keys: its own overlapped compressor at ``index_head_dim`` + RoPE; queries:
    ``wq_b(qr)`` + RoPE; ``I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s])`` with
    ``w = weights_proj(x) / sqrt(index_head_dim * index_n_heads)``."""

    def __init__(self, config: ModelConfig, layer_id: int, factory: LinearFactory) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.wq_b = factory.quantised(config.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = factory.dense(config.hidden_size, self.n_heads)
        self.compressor = Compressor(
            self.head_dim,
            config.compress_ratios[layer_id],
            overlap=True,
            with_ape=True,
            factory=factory,
            eps=config.rms_norm_eps,
        )
        self.weight_scale = (self.head_dim * self.n_heads) ** -0.5
        self.rounding = variant_of(config).kv_rounding(config)  # spec 2.6

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext, plan: CompressionPlan
    ) -> torch.Tensor:
        """Returns the chosen arena rows ``[T, index_topk]`` (``-1`` = none)."""
        key = f"{self.layer_id}.index_keys"
        entries = self.compressor(ctx.keys_of(x), ctx, plan, f"{self.layer_id}.index_comp")
        cos_e, sin_e = ctx.entry_angles(plan)
        entries = self.rounding.index(K.apply_rope(entries, cos_e, sin_e, out=entries))
        ctx.cache.write(key, plan.emit_rows, entries)
        cos, sin = ctx.angles[True]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = K.apply_rope(q, cos, sin, out=q)
        q = self.rounding.index(q)
        weights = self.weights_proj(x, out_dtype=torch.float32) * self.weight_scale
        scores = K.indexer_scores(q, weights, *ctx.arena_reads(key, plan))
        return K.select_topk(scores, plan.seq_rows, plan.q_seq, self.topk)
