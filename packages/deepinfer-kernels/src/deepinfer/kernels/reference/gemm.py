"""Reference FP8 x FP8 block-scaled GEMM."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import quant


def dequant_activation(a: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` e4m3 with ``[M, K / g]`` fp32 scales -> exact fp32 ``[M, K]``."""
    groups = a_scale.shape[-1]
    if groups == 0 or a.shape[-1] % groups:
        raise ValueError(
            f"a_scale: {groups} groups per row must divide K={a.shape[-1]} "
            f"(a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)})"
        )
    grouped = a.float().unflatten(-1, (groups, -1)) * a_scale.float().unsqueeze(-1)
    return grouped.flatten(-2)


def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    w = quant.fp8_block_dequant(b, b_scale, block_size, out_dtype=torch.float32)
    return (dequant_activation(a, a_scale) @ w.t()).to(out_dtype)
