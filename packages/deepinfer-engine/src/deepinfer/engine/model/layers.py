"""Leaf modules holding checkpoint tensors: linears in their stored formats, norms, embedding.

Parameters carry the official checkpoint names and stored dtypes, so the ``state_dict`` of a
model built on the meta device is the tensor inventory a checkpoint must match.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import deepinfer.kernels as K

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def _frozen(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T`` with ``W`` dense (``fmt="dense"``), FP8 block-scaled (``"fp8"``: ``weight``
    e4m3 ``[out, in]`` + ``scale`` e8m0 ``[ceil(out/bm), ceil(in/bn)]``) or packed FP4
    (``"fp4"``: ``weight`` int8 ``[out, in/2]`` + ``scale`` e8m0 ``[out, in/32]``).

    ``act_quant_group``: round the input to FP8 per group of that many elements first, as the
    official inference feeds its FP8 / FP4 GEMMs (spec 4.3); :class:`LinearFactory` sets it on
    exactly the linears stored FP8 / FP4 (``numerics="model"``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        fmt: str = "dense",
        dtype: torch.dtype = torch.bfloat16,
        block: tuple[int, int] | None = None,
        act_quant_group: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.block = block
        self.act_quant_group = act_quant_group
        if fmt == "dense":
            self.weight = _frozen((out_features, in_features), dtype, device)
            self.scale = None
        elif fmt == "fp8":
            bm, bn = block
            self.weight = _frozen((out_features, in_features), FP8, device)
            scale_shape = (math.ceil(out_features / bm), math.ceil(in_features / bn))
            self.scale = _frozen(scale_shape, E8M0, device)
        elif fmt == "fp4":
            self.weight = _frozen((out_features, in_features // 2), torch.int8, device)
            self.scale = _frozen((out_features, in_features // 32), E8M0, device)
        else:
            raise ValueError(f"Linear fmt {fmt!r}: expected dense, fp8 or fp4")

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return K.linear(
            x,
            self.weight,
            self.scale,
            block_size=self.block,
            act_quant_group=self.act_quant_group,
            out_dtype=out_dtype,
        )

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


def project(x: torch.Tensor, *linears: Linear) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``; linears of one storage format and input
    quantisation go through one :func:`deepinfer.kernels.linears` call, which quantises ``x``
    once for all of them (bit for bit the separate calls)."""
    first = linears[0]
    same = all(
        (m.fmt, m.block, m.act_quant_group) == (first.fmt, first.block, first.act_quant_group)
        for m in linears
    )
    if not same or first.act_quant_group is None:
        return tuple(m(x) for m in linears)
    return K.linears(
        x,
        tuple(m.weight for m in linears),
        tuple(m.scale for m in linears),
        block_size=first.block,
        act_quant_group=first.act_quant_group,
    )


class RMSNorm(nn.Module):
    """Weighted RMSNorm (fp32 inside), weight stored in the checkpoint dtype."""

    def __init__(self, dim: int, eps: float, *, dtype=torch.bfloat16, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    """Token embedding ``weight [vocab, dim]``."""

    def __init__(self, vocab: int, dim: int, *, dtype=torch.bfloat16, device=None) -> None:
        super().__init__()
        self.weight = _frozen((vocab, dim), dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]


class LinearFactory:
    """Builds the :class:`Linear` of each checkpoint role in the config's storage format."""

    def __init__(self, config, dtype: torch.dtype, device=None) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        q = config.quantization
        self.block = None if q is None else q.weight_block_size
        # FP8 inputs exactly where the weights are FP8 / FP4: only a quantised checkpoint has any
        self.act_group = None
        if q is not None and config.numerics == "model":
            self.act_group = q.weight_block_size[1]

    def quantised(self, in_f: int, out_f: int) -> Linear:
        """A linear stored FP8 in a quantised checkpoint (dense otherwise)."""
        fmt = "dense" if self.block is None else "fp8"
        return self._make(in_f, out_f, fmt, self.act_group)

    def expert(self, in_f: int, out_f: int) -> Linear:
        q = self.config.quantization
        fmt = "dense" if q is None else ("fp4" if q.expert_dtype == "fp4" else "fp8")
        return self._make(in_f, out_f, fmt, self.act_group)

    def dense(self, in_f: int, out_f: int) -> Linear:
        """A linear the checkpoint always stores in floating point (no input quantisation)."""
        return self._make(in_f, out_f, "dense", None)

    def _make(self, in_f: int, out_f: int, fmt: str, act_group: int | None) -> Linear:
        return Linear(
            in_f,
            out_f,
            fmt=fmt,
            dtype=self.dtype,
            block=self.block,
            act_quant_group=act_group,
            device=self.device,
        )
