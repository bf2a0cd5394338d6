"""Quantised formats of the DeepSeek-V4 checkpoints and the reference quantisation numerics.

Scale bytes are ue8m0 (``torch.float8_e8m0fnu``): a pure exponent, value ``2^(byte - 127)``,
byte 255 is NaN. A scale *multiplies* the stored value (``w = q * scale``), whatever the old HF
name ``weight_scale_inv`` suggests.

FP4 (e2m1) packing: ``int8 [..., K/2]``; byte ``k`` holds logical column ``2k`` in its low nibble
and ``2k + 1`` in its high nibble. Nibble code -> value: ``0, .5, 1, 1.5, 2, 3, 4, 6`` for codes
0..7, the same negated for 8..15 (bit 3 is the sign; 8 is -0.0).

Rounding to e4m3 / e2m1 is round-to-nearest-even after clamping to the format's max (448 / 6).
"""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import quant as ref
from deepinfer.kernels.registry import op

__all__ = [
    "fp8_block_dequant",
    "fp8_block_quant",
    "fp4_dequant",
    "fp4_quant",
    "fp8_act_quant",
    "fp8_sim",
    "fp4_sim",
]


@op(reference=ref.fp8_block_dequant)
def fp8_block_dequant(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """FP8 block weight -> float: ``w[r, c] = q[r, c] * 2^(scale[r // bm, c // bn] - 127)``.

    weight:     ``[out, in]`` ``float8_e4m3fn``.
    scale:      ``[ceil(out / bm), ceil(in / bn)]`` ``float8_e8m0fnu`` (or its ``uint8`` bytes).
    block_size: ``(bm, bn)``: ``(128, 128)`` in V4, ``(32, 32)`` in V4.1, ``(1, 32)`` for the
                V4.1 Engram tables (one scale per 32 columns of a row).
    Returns ``[out, in]`` of ``out_dtype``; computed in fp32 and exact (a power-of-two multiple
    of an e4m3 value is representable in bf16 and fp32).
    """


@op(reference=ref.fp8_block_quant)
def fp8_block_quant(
    weight: torch.Tensor, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight -> ``(q, scale)`` in the FP8 block format read by :func:`fp8_block_dequant`.

    weight: ``[out, in]`` any float dtype. Per ``bm x bn`` block (edge blocks partial), the scale
    is ``2^ceil(log2(max(amax, 1e-4) / 448))`` and ``q = e4m3(w / scale)``.
    Returns ``q`` ``[out, in]`` ``float8_e4m3fn`` and ``scale``
    ``[ceil(out / bm), ceil(in / bn)]`` ``float8_e8m0fnu``. Used to write checkpoints.
    """


@op(reference=ref.fp4_dequant)
def fp4_dequant(
    packed: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = 32,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Packed FP4 (e2m1) -> float: ``w[..., c] = e2m1(nibble c) * 2^(scale[..., c // 32] - 127)``.

    packed: ``[..., K/2]`` ``int8`` (or ``uint8``), nibble order as in the module docstring.
    scale:  ``[..., K / block_size]`` ``float8_e8m0fnu`` (or its ``uint8`` bytes).
    Returns ``[..., K]`` of ``out_dtype`` (exact in bf16 and fp32).
    """


@op(reference=ref.fp4_quant)
def fp4_quant(weight: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight -> ``(packed, scale)`` in the FP4 expert format read by :func:`fp4_dequant`.

    weight: ``[..., K]`` any float dtype, ``K`` a multiple of ``block_size`` (and even).
    Per group of ``block_size`` columns the scale is ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``
    and each value is rounded to e2m1 after dividing by it.
    Returns ``packed`` ``[..., K/2]`` ``int8`` and ``scale`` ``[..., K / block_size]``
    ``float8_e8m0fnu``.
    """


@op(reference=ref.fp8_act_quant)
def fp8_act_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation -> FP8 per token-group, as the reference does before each quantised linear.

    x: ``[..., K]`` float, ``K`` a multiple of ``group_size`` (128 in V4, 32 in V4.1).
    Per group of ``group_size`` contiguous elements: ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``
    (a ue8m0 value), ``q = e4m3(clamp(x / s, -448, 448))``.
    Returns ``q`` ``[..., K]`` ``float8_e4m3fn`` and ``s`` ``[..., K / group_size]`` fp32.
    """


@op(reference=ref.fp8_sim)
def fp8_sim(x: torch.Tensor, block_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 round trip ``q * s`` of :func:`fp8_act_quant` (quantise-then-dequantise).

    x: ``[..., K]`` float, ``K`` a multiple of ``block_size``. The reference uses block 64 on
    the V4 KV nope dims, 32 on the whole V4.1 window KV row, and the activation group (128 /
    32) to simulate the input quantisation of a quantised linear.
    out: optional ``[..., K]`` of ``x.dtype`` (may be ``x`` itself: the in-place form).
    Returns ``[..., K]`` of ``x.dtype`` (exact: e4m3 times a power of two fits bf16).
    """


@op(reference=ref.fp4_sim)
def fp4_sim(
    x: torch.Tensor,
    block_size: int,
    *,
    scale_fmt: str = "ue8m0",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP4 (e2m1) round trip per block of ``block_size`` contiguous elements of the last dim.

    x: ``[..., K]`` float, ``K`` a multiple of ``block_size``.
    scale_fmt ``"ue8m0"`` (V4 indexer q/k, V4.1 indexer, block 32):
        ``s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))``;
    scale_fmt ``"e4m3"`` (V4.1 compressed latent, block 16):
        ``s = e4m3(max(amax, 6 * 2^-9) / 6)``.
    Then ``x <- e2m1(clamp(x / s, -6, 6)) * s`` (computed in fp32).
    out: optional ``[..., K]`` of ``x.dtype`` (may be ``x`` itself).
    Returns ``[..., K]`` of ``x.dtype``.
    """
