"""One decoder block: attention and MoE, each between two mHC sites."""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.attention import Attention
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.hc import HyperConnection
from deepinfer.engine.model.layers import LinearFactory, RMSNorm
from deepinfer.engine.model.moe import MoE


class Block(nn.Module):
    """Params: ``attn_norm``, ``ffn_norm``, ``attn``, ``ffn``, ``hc_attn_*``, ``hc_ffn_*``."""

    def __init__(self, config: ModelConfig, layer_id: int, factory: LinearFactory) -> None:
        super().__init__()
        c, f = config, factory
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.attn = Attention(c, layer_id, f)
        self.ffn = MoE(c, layer_id, f)
        HyperConnection.register(self, "hc_attn", c, f.device)
        HyperConnection.register(self, "hc_ffn", c, f.device)
        self.hc = HyperConnection(c)

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
        f = self.ffn(self.ffn_norm(K.hc_collapse(h, pre)), ctx.input_ids)
        return K.hc_expand(f, h, post, comb)
