"""Reference linear over the checkpoint weight formats."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import quant


def dequant_weight(
    weight: torch.Tensor, scale: torch.Tensor | None, block_size: tuple[int, int] | None
) -> torch.Tensor:
    if scale is None:
        return weight
    if weight.dtype == torch.float8_e4m3fn:
        return quant.fp8_block_dequant(weight, scale, block_size, out_dtype=torch.float32)
    if weight.dtype in (torch.int8, torch.uint8):
        return quant.fp4_dequant(weight, scale, 32, out_dtype=torch.float32)
    raise TypeError(f"weight dtype {weight.dtype} with a scale: expected float8_e4m3fn or int8")


def linear_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block_size: tuple[int, int] | None,
    act_quant_group: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x``, the weight ``[N, K]``) as the reference multiplies them: a plain weight in the
    promoted dtype; a scaled one dequantised, in fp32, with ``x`` FP8-rounded per
    ``act_quant_group`` when given."""
    w = dequant_weight(weight, scale, block_size)
    if scale is None and act_quant_group is None:
        compute = torch.promote_types(x.dtype, w.dtype)
        return x.to(compute), w.to(compute)
    xf = x.float()
    if act_quant_group is not None:
        xf = quant.fp8_sim(xf, act_quant_group)
    return xf, w.float()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
    act_quant_group: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    xc, wc = linear_operands(x, weight, scale, block_size, act_quant_group)
    return (xc @ wc.t()).to(out_dtype or x.dtype)


def linears(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor | None, ...],
    *,
    block_size: tuple[int, int] | None = None,
    act_quant_group: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    if len(weights) != len(scales):
        raise ValueError(f"{len(weights)} weights, {len(scales)} scales: expected one scale each")
    kw = {"block_size": block_size, "act_quant_group": act_quant_group, "out_dtype": out_dtype}
    return tuple(linear(x, w, s, **kw) for w, s in zip(weights, scales, strict=True))


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    groups = x.shape[-2]
    w = dequant_weight(weight, scale, block_size).unflatten(0, (groups, -1))
    compute = torch.promote_types(x.dtype, w.dtype)
    return torch.einsum("tgk,gnk->tgn", x.to(compute), w.to(compute)).to(x.dtype)
