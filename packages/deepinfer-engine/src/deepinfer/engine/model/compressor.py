"""Compressor: pools each complete window of ``ratio`` tokens into one KV entry."""

from __future__ import annotations

from dataclasses import dataclass

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
        split, step_rows = state_kv.shape[0], kv.shape[0]
        sources = ctx.shared(
            "emit_sources", plan.emit_src, lambda: TwoSources.of(plan.emit_src, split, step_rows),
            split, step_rows,
        )  # fmt: skip
        kv_rows = sources.take(state_kv, kv)
        # take returns fresh rows: mask them in place
        score_rows = sources.take(state_score, score).masked_fill_(sources.missing, float("-inf"))
        if self.overlap:
            kv_rows, score_rows = self._overlap(kv_rows), self._overlap(score_rows)
        pooled = K.compress_pool(kv_rows, score_rows, out_dtype=x.dtype)  # rounded in the op
        state_kv.index_copy_(0, plan.state_write_dst, kv[plan.state_write_src])
        state_score.index_copy_(0, plan.state_write_dst, score[plan.state_write_src])
        return self.norm(pooled)

    def _overlap(self, rows: torch.Tensor) -> torch.Tensor:
        """``[E, 2r, 2d]`` -> ``[E, 2r, d]``: previous window's first half, this one's second."""
        r, d = self.ratio, self.dim
        return torch.cat([rows[:, :r, :d], rows[:, r:, d:]], dim=1)


@dataclass(frozen=True)
class TwoSources:
    """Where the rows ``[E, L]`` of ``[first | second]`` (``first``: the whole state pool of
    ``split`` rows; ``second``: the step's rows; ``-1``: none) are, to gather them without
    copying ``first``: rows below ``split`` from ``first``, the rest from ``second``. Computed
    once a step per plan (every compressor of a kind gathers the same rows)."""

    in_first: torch.Tensor | None  # [E, L] bool; None: the pool is empty
    first_rows: torch.Tensor | None
    second_rows: torch.Tensor
    missing: torch.Tensor  # [E, L, 1] bool, the -1 rows

    @staticmethod
    def of(rows: torch.Tensor, split: int, num_second: int) -> TwoSources:
        src = rows.clamp(min=0)
        second = (src - split).clamp(min=0, max=max(num_second - 1, 0))
        missing = (rows < 0).unsqueeze(-1)
        if not split:
            return TwoSources(None, None, second, missing)
        in_first = src < split
        return TwoSources(in_first, src.clamp(max=max(split - 1, 0)), second, missing)

    def take(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``torch.cat([first, second])[rows]`` (``rows`` clamped at 0)."""
        from_second = second[self.second_rows]
        if self.in_first is None:
            return from_second
        in_first = self.in_first.view(*self.in_first.shape, *([1] * (first.dim() - 1)))
        return torch.where(in_first, first[self.first_rows], from_second)
