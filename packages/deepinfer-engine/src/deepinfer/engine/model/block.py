"""One decoder block: attention and MoE, each between two mHC sites."""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.attention import Attention
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.engram import Engram, EngramConfig
from deepinfer.engine.model.hc import HyperConnection
from deepinfer.engine.model.layers import LinearFactory, RMSNorm
from deepinfer.engine.model.moe import MoE
from deepinfer.parallel import ExpertParallelContext


class Block(nn.Module):
    """Params: ``attn_norm``, ``ffn_norm``, ``attn``, ``ffn``, ``hc_attn_*``, ``hc_ffn_*`` and,
    at V4.1 Engram layers, ``engram``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        factory: LinearFactory,
        expert_parallel: ExpertParallelContext | None = None,
    ) -> None:
        super().__init__()
        c, f = config, factory
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.attn = Attention(c, layer_id, f)
        self.ffn = MoE(c, layer_id, f, expert_parallel=expert_parallel)
        HyperConnection.register(self, "hc_attn", c, f.device)
        HyperConnection.register(self, "hc_ffn", c, f.device)
        self.hc = HyperConnection(c)
        self.engram = None
        if layer_id in c.engram_layer_ids:
            self.engram = Engram(EngramConfig.from_model_config(c, layer_id), f)
            self.engram_index = c.engram_layer_ids.index(layer_id)

    def attn_coefficients(self, h: torch.Tensor):
        return self.hc.coefficients(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)

    def ffn_coefficients(self, h: torch.Tensor):
        return self.hc.coefficients(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """V4 block: streams ``[T, nc, D]`` -> ``[T, nc, D]``."""
        pre, post, comb = self.attn_coefficients(h)
        a = self.attn(self.attn_norm(K.hc_collapse(h, pre)), ctx)
        h = K.hc_expand(a, h, post, comb)
        pre, post, comb = self.ffn_coefficients(h)
        f = self.ffn(self.ffn_norm(K.hc_collapse(h, pre)), ctx.input_ids, ctx.positions)
        return K.hc_expand(f, h, post, comb)

    def forward_v41(
        self, h: torch.Tensor, pre: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1 block with deferred pre-mix (spec 7.1): Engram on the entering streams, then
        each site's ``pre`` collapses the streams of the *next* sublayer.
        (h ``[T, nc, D]``, pre ``[T, nc]``) -> (h, this block's FFN-site pre)."""
        if self.engram is not None:
            h = self.engram(h, ctx.engram_rows[:, self.engram_index], ctx.token_mask)
        ctx.record_tap(self.layer_id, h)  # V4.1 taps the streams entering the layer
        attn_pre, post, comb = self.attn_coefficients(h)
        a = self.attn(self.attn_norm(K.hc_collapse(h, pre)), ctx)
        h = K.hc_expand(a, h, post, comb)
        ffn_pre, post, comb = self.ffn_coefficients(h)
        x = self.ffn_norm(K.hc_collapse(h, attn_pre))
        f = self.ffn(x, ctx.input_ids, ctx.positions, image_mask=ctx.image_mask)
        return K.hc_expand(f, h, post, comb), ffn_pre
