"""Reference RMSNorm: computed in fp32, rounded once to the input dtype."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x.float() + residual.float()).to(residual.dtype)
    if residual_out is None:
        residual_out = summed
    else:
        residual_out.copy_(summed)
    return rms_norm(summed, weight, eps, out=out), residual_out
