"""FP8 x FP8 block-scaled GEMM: the product behind every FP8-weight linear of the checkpoints."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import gemm as ref
from deepinfer.kernels.registry import op

__all__ = ["fp8_gemm_nt"]


@op(reference=ref.fp8_gemm_nt)
def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``c = (a * a_scale) @ (b * b_scale)^T`` with fp32 accumulation ("NT": both K-major).

    a:          ``[M, K]`` ``float8_e4m3fn``, the activation as :func:`fp8_act_quant` makes it.
    a_scale:    ``[M, K / g]`` fp32, one (power-of-two) scale per ``g`` contiguous elements of a
                row; ``g`` is read off the shape (128 in V4, 32 in V4.1) and must divide K.
    b:          ``[N, K]`` ``float8_e4m3fn`` weight.
    b_scale:    ``[ceil(N / bm), ceil(K / bk)]`` ``float8_e8m0fnu`` (or its ``uint8`` bytes).
    block_size: ``(bm, bk)`` of the weight blocks: ``(128, 128)`` in V4, ``(32, 32)`` in V4.1.
    Returns ``[M, N]`` of ``out_dtype``. Every product of two scaled e4m3 values is exact in
    fp32, so an implementation differs from the reference only by fp32 summation order and the
    final rounding to ``out_dtype``.
    """
