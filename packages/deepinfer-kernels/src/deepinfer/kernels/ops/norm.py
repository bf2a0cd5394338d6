"""RMSNorm, plain and fused with the residual add."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import norm as ref
from deepinfer.kernels.registry import op

__all__ = ["rms_norm", "fused_add_rms_norm"]


@op(reference=ref.rms_norm)
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x / sqrt(mean(x**2, -1) + eps) * weight``.

    x:      ``[..., H]`` float32 / bfloat16 / float16, any strides.
    weight: ``[H]``, any float dtype (read as fp32).
    out:    optional ``[..., H]`` of ``x.dtype`` to write into; returned.
    Computed in fp32 per row, rounded once to ``x.dtype``. Rows are independent: a row's result
    never depends on the other rows (batch invariant by construction).
    """


@op(reference=ref.fused_add_rms_norm)
def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to ``residual.dtype``), returns ``(rms_norm(s), s)``.

    x, residual: ``[..., H]``, same shape; residual's dtype is the stream dtype.
    weight:      ``[H]``.
    out / residual_out: optional destinations of the normed value and of ``s``.
    The sum is formed in fp32 and rounded to ``residual.dtype`` before normalising, so the
    normalised value is exactly ``rms_norm(s)`` of the returned ``s``.
    """
