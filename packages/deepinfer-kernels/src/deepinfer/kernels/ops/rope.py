"""Rotary position embedding: interleaved pairs on the trailing dims of each head."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import rope as ref
from deepinfer.kernels.registry import op

__all__ = ["apply_rope"]


@op(reference=ref.apply_rope)
def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``rd = 2 * cos.shape[-1]`` channels of every row of ``x``.

    x:    ``[N, ..., D]`` (``[N, D]`` or ``[N, H, D]``) fp32 / bf16; channels ``D - rd ..`` are
          ``rd / 2`` interleaved pairs ``(2i, 2i + 1)``; the leading ``D - rd`` pass through.
    cos, sin: ``[N, rd / 2]`` fp32, the angle of pair ``i`` at row ``n``'s position.
    inverse: rotate by the conjugate (``-angle``), used on the attention output.
    ``(a, b) -> (a cos - b sin, a sin + b cos)`` computed in fp32, returned in ``x.dtype`` as a
    new tensor. Rows are independent.
    """
