"""V4.1 indexer (CSA2): keys derived once per kv-source group from the compressor's latent,
queries scored at index-source layers, a candidate-block pre-filter from the candidate source.

Checkpoint tensors (``layers.{i}.attn.indexer.``): ``wk`` ``[index_head_dim, head_dim]`` and
``k_norm`` at kv sources; ``wq_b`` (FP8) and ``weights_proj`` at index sources.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import LinearFactory, RMSNorm
from deepinfer.engine.model.metadata import CompressionPlan
from deepinfer.engine.model.variant import variant_of


class IndexerV41(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, factory: LinearFactory) -> None:
        super().__init__()
        c, f = config, factory
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.rounding = variant_of(c).kv_rounding(c)
        self.owns_keys = c.owns_compressor(layer_id)
        self.owns_queries = c.owns_indexer(layer_id)
        cand = c.candidate_source_layer_id
        self.is_candidate_source = cand == layer_id
        self.uses_candidates = cand is not None and cand < layer_id
        self.candidate_topk_blocks, self.candidate_block_size = (
            c.candidate_topk_blocks,
            c.candidate_block_size,
        )
        if self.owns_keys:
            self.wk = f.dense(c.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        if self.owns_queries:
            self.wq_b = f.quantised(c.q_lora_rank, self.n_heads * self.head_dim)
            self.weights_proj = f.dense(c.hidden_size, self.n_heads)
        self.weight_scale = (self.head_dim * self.n_heads) ** -0.5

    def write_keys(
        self,
        latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        store: Callable[[torch.Tensor, torch.Tensor], None],
        plan: CompressionPlan,
    ) -> None:
        """Index keys of the entries completed this step, from the pre-RoPE latent, handed to
        ``store(arena rows, key rows)`` (the cache packs them in its format)."""
        k = self.k_norm(self.wk(latent))
        k = K.apply_rope(k, cos, sin, out=k)
        k = self.rounding.index(k)
        store(plan.emit_rows, k)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        ctx: StepContext,
        plan: CompressionPlan,
        keys: str,
    ) -> torch.Tensor:
        """Chosen arena rows ``[T, index_topk]`` (``-1`` = none) of this index source, scored
        against the index keys of cache tensor ``keys``."""
        cos, sin = ctx.angles[True]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = K.apply_rope(q, cos, sin, out=q)
        q = self.rounding.index(q)
        weights = self.weights_proj(x, out_dtype=torch.float32) * self.weight_scale
        scores = K.indexer_scores(q, weights, *ctx.arena_reads(keys, plan))
        if self.is_candidate_source:
            ctx.candidate_mask = K.candidate_block_mask(
                scores, plan.visible_count, self.candidate_topk_blocks, self.candidate_block_size
            )
        elif self.uses_candidates and ctx.candidate_mask is not None:
            scores = scores.masked_fill(~ctx.candidate_mask, float("-inf"))
        return K.select_topk(scores, plan.seq_rows, plan.q_seq, self.topk)
