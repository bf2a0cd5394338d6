"""Linear layers over the weight formats of the checkpoints."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import linear as ref
from deepinfer.kernels.registry import op

__all__ = ["linear", "linears", "grouped_linear"]


@op(reference=ref.linear)
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
    act_quant_group: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y = x @ W^T`` for a dense, FP8 block-scaled or packed-FP4 weight.

    x:      ``[..., K]`` fp32 / bf16.
    weight: ``[N, K]`` float (no scale), ``[N, K]`` ``float8_e4m3fn`` with
            ``scale [ceil(N / bm), ceil(K / bn)]`` e8m0 and ``block_size = (bm, bn)``, or
            ``[N, K / 2]`` int8 packed e2m1 with ``scale [N, K / 32]`` e8m0.
    act_quant_group: if set, simulate the reference's FP8 input quantisation per group of
            that many elements along K (spec 4.3) before the product.
    Dense weights multiply in the promoted dtype; quantised ones dequantise exactly and
    accumulate in fp32. Returns ``[..., N]`` of ``out_dtype`` (default ``x.dtype``).
    """


@op(reference=ref.linears)
def linears(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor | None, ...],
    *,
    block_size: tuple[int, int] | None = None,
    act_quant_group: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """Several linears of one input: ``tuple(linear(x, w, s, ...) for w, s in zip(weights,
    scales))``, each output bit for bit what :func:`linear` returns for its weight.

    x, each weight and scale, ``block_size``, ``act_quant_group``, ``out_dtype``: as in
    :func:`linear` (one ``block_size`` and ``act_quant_group`` for all). A backend may quantise
    ``x`` to FP8 once for every FP8 weight (one launch instead of one per weight).
    """


@op(reference=ref.grouped_linear)
def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Block-diagonal projection: group ``g`` of ``x`` times its own slice of ``weight``.

    x:      ``[T, G, K]``; weight ``[G * N, K]`` (rows ``g*N .. g*N+N-1`` belong to group g),
            dense or FP8 block-scaled (``scale``, ``block_size`` as in :func:`linear`; the
            reference dequantises it, no activation quantisation -- V4's ``wo_a``).
    ``y[t, g] = x[t, g] @ weight[g]^T`` in the promoted dtype. Returns ``[T, G, N]`` of
    ``x.dtype``.
    """
