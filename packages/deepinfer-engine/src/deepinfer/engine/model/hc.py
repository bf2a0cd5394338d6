"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

The checkpoint stores each site's parameters on the owning block (``hc_attn_fn`` ...), so
:class:`HyperConnection` holds the three tensors of one site and computes its weights.
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig


def _param(shape, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


class HyperConnection:
    """One mHC site: ``fn [(2+nc)nc, nc D]``, ``base [(2+nc)nc]``, ``scale [3]`` (fp32)."""

    def __init__(self, config: ModelConfig) -> None:
        self.norm_eps, self.hc_eps = config.rms_norm_eps, config.hc_eps
        self.iters = config.hc_sinkhorn_iters

    @staticmethod
    def register(module: nn.Module, prefix: str, config: ModelConfig, device=None) -> None:
        nc, dim = config.hc_mult, config.hidden_size
        width = (2 + nc) * nc
        module.register_parameter(f"{prefix}_fn", _param((width, nc * dim), device))
        module.register_parameter(f"{prefix}_base", _param((width,), device))
        module.register_parameter(f"{prefix}_scale", _param((3,), device))

    def coefficients(self, h: torch.Tensor, fn, base, scale):
        """h ``[T, nc, D]`` -> pre ``[T, nc]``, post ``[T, nc]``, comb ``[T, nc, nc]`` fp32."""
        return K.hc_mix_coefficients(
            h,
            fn,
            base,
            scale,
            norm_eps=self.norm_eps,
            hc_eps=self.hc_eps,
            sinkhorn_iters=self.iters,
        )


class HyperHead(nn.Module):
    """V4's final collapse of the streams (``hc_head_fn/base/scale`` on the model)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm_eps, self.hc_eps = config.rms_norm_eps, config.hc_eps

    def forward(self, h: torch.Tensor, fn, base, scale) -> torch.Tensor:
        pre = K.hc_head_coefficients(h, fn, base, scale, norm_eps=self.norm_eps, hc_eps=self.hc_eps)
        return K.hc_collapse(h, pre)
