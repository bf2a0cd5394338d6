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
            state_rows = ctx.cache[f"{state}_kv"].shape[0]
            return self.norm(self.wkv(x))[plan.emit_src[:, 0] - state_rows]
        kv = self.wkv(x, out_dtype=torch.float32)
        score = self.wgate(x, out_dtype=torch.float32)
        if self.ape is not None:
            score = score + self.ape[ctx.positions_of_keys() % self.ratio]
        state_kv, state_score = ctx.cache[f"{state}_kv"], ctx.cache[f"{state}_score"]
        src = plan.emit_src.clamp(min=0)
        missing = (plan.emit_src < 0).unsqueeze(-1)
        kv_rows = _gather_two(state_kv, kv, src)
        score_rows = _gather_two(state_score, score, src).masked_fill(missing, float("-inf"))
        if self.overlap:
            kv_rows, score_rows = self._overlap(kv_rows), self._overlap(score_rows)
        pooled = K.compress_pool(kv_rows, score_rows)
        state_kv.index_copy_(0, plan.state_write_dst, kv[plan.state_write_src])
        state_score.index_copy_(0, plan.state_write_dst, score[plan.state_write_src])
        return self.norm(pooled.to(x.dtype))

    def _overlap(self, rows: torch.Tensor) -> torch.Tensor:
        """``[E, 2r, 2d]`` -> ``[E, 2r, d]``: previous window's first half, this one's second."""
        r, d = self.ratio, self.dim
        return torch.cat([rows[:, :r, :d], rows[:, r:, d:]], dim=1)


def _gather_two(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``torch.cat([first, second])[rows]`` without copying ``first`` (the whole state pool):
    rows below ``len(first)`` come from it, the rest from ``second``."""
    split = first.shape[0]
    in_first = (rows < split).view(*rows.shape, *([1] * (first.dim() - 1)))
    from_first = first[rows.clamp(max=max(split - 1, 0))] if split else None
    from_second = second[(rows - split).clamp(min=0, max=max(second.shape[0] - 1, 0))]
    if from_first is None:
        return from_second
    return torch.where(in_first, from_first, from_second)
