"""Compressor: pools each complete window of ``ratio`` tokens into one KV entry."""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import LinearFactory, RMSNorm
from deepinfer.engine.model.metadata import CompressionPlan


class Compressor(nn.Module):
    """``entry_w = norm(sum_j softmax_j(z_j + ape_j) c_j)`` per channel, fp32 pooling.

    V4 ratio 4 overlaps: projections are ``2 dim`` wide; entry ``w`` pools the first halves of
    window ``w - 1`` with the second halves of window ``w``. V4 ratio 128 and V4.1 ratio 1 / 2 use
    one window of ``dim``-wide rows (V4.1 has no ``ape``). V4.1 ratio 1 has no ``wgate``: every
    token is its own entry, ``norm(wkv(x))`` in the model dtype. Returns entries before RoPE.
    """

    def __init__(
        self,
        dim: int,
        ratio: int,
        *,
        overlap: bool,
        with_ape: bool,
        factory: LinearFactory,
        eps: float,
    ) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        coff = 2 if overlap else 1
        hidden = factory.config.hidden_size
        self.wkv = factory.dense(hidden, coff * dim)
        self.wgate = factory.dense(hidden, coff * dim) if ratio > 1 else None
        if with_ape:
            ape = torch.empty(ratio, coff * dim, dtype=torch.float32, device=factory.device)
            self.ape = nn.Parameter(ape, requires_grad=False)
        else:
            self.ape = None
        self.norm = RMSNorm(dim, eps, dtype=factory.dtype, device=factory.device)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, plan: CompressionPlan, state: str
    ) -> torch.Tensor:
        """x ``[T, D]`` -> the entries completed this step ``[E, dim]`` in ``x.dtype``."""
        if self.wgate is None:  # ratio 1: entry w is token w, emitted in this very step
            split, src = ctx.cache[f"{state}_kv"].shape[0], plan.emit_src
            rows = ctx.shared("emit_step_rows", src, lambda: src[:, 0] - split, split)
            return self.norm(self.wkv(x))[rows]
        kv = self.wkv(x, out_dtype=torch.float32)
        score = self.wgate(x, out_dtype=torch.float32)
        if self.ape is not None:
            keys = ctx.positions_of_keys()
            phase = ctx.shared("phase", keys, lambda: keys % self.ratio, self.ratio)
            score = score + self.ape[phase]
        state_kv, state_score = ctx.cache[f"{state}_kv"], ctx.cache[f"{state}_score"]
        # the windows' rows read from the state pool and this step's rows in the op (no copy of
        # the pool, no gathered windows); rounded to x.dtype in the op
        pooled = K.compress_gather_pool(state_kv, state_score, kv, score, plan.emit_src,
                                        overlap=self.overlap, out_dtype=x.dtype)  # fmt: skip
        K.write_state_rows(state_kv, state_score, plan.state_write_dst, kv, score,
                           plan.state_write_src)  # fmt: skip
        return self.norm(pooled)
