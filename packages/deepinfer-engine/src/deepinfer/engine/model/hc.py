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

    @staticmethod
    def attach(owner: nn.Module, config: ModelConfig, device=None) -> None:
        """Give ``owner`` (the model or a last draft stage) ``hc_head_fn [nc, nc D]``,
        ``hc_head_base [nc]``, ``hc_head_scale [1]`` (fp32, the checkpoint's names) and the
        ``hc_head`` that reads them."""
        nc = config.hc_mult
        for name, shape in (
            ("fn", (nc, nc * config.hidden_size)),
            ("base", (nc,)),
            ("scale", (1,)),
        ):
            owner.register_parameter(f"hc_head_{name}", _param(shape, device))
        owner.hc_head = HyperHead(config)

    def forward(self, h: torch.Tensor, fn, base, scale) -> torch.Tensor:
        pre = K.hc_head_coefficients(h, fn, base, scale, norm_eps=self.norm_eps, hc_eps=self.hc_eps)
        return K.hc_collapse(h, pre)


class ImmediateMix:
    """V4's threading of the streams through a stack of blocks: each block collapses the
    streams at its own sites, and the stack ends with the owner's ``hc_head`` collapse."""

    @staticmethod
    def run(blocks, streams: torch.Tensor, ctx) -> tuple[torch.Tensor, None]:
        """(streams after ``blocks``, None); V4-0731 taps each layer's output (spec C2)."""
        for block in blocks:
            streams = block(streams, ctx)
            ctx.record_tap(block.layer_id, streams)
        return streams, None

    @staticmethod
    def attach_head(owner: nn.Module, config: ModelConfig, device=None) -> None:
        HyperHead.attach(owner, config, device)

    @staticmethod
    def collapse(owner: nn.Module, streams: torch.Tensor, pre: None) -> torch.Tensor:
        """Streams ``[N, nc, D]`` -> ``[N, D]`` with the owner's ``hc_head_fn / base / scale``."""
        return owner.hc_head(streams, owner.hc_head_fn, owner.hc_head_base, owner.hc_head_scale)


class DeferredMix:
    """V4.1's deferred pre-mix (spec 7.1): each site's ``pre`` collapses the streams of the
    *next* sublayer, the chain starts on stream 0 and the last FFN site's ``pre`` makes the
    final collapse (no ``hc_head``)."""

    @staticmethod
    def run(blocks, streams: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams after ``blocks``, the last block's FFN-site ``pre`` ``[T, nc]``)."""
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first block's attention reads stream 0
        for block in blocks:
            streams, pre = block.forward_v41(streams, pre, ctx)
        return streams, pre

    @staticmethod
    def attach_head(owner: nn.Module, config: ModelConfig, device=None) -> None:
        """Nothing to attach: the deferred ``pre`` collapses the final streams."""

    @staticmethod
    def collapse(owner: nn.Module, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return K.hc_collapse(streams, pre)
