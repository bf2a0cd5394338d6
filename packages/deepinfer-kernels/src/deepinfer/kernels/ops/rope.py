"""Rotary position embedding: interleaved pairs on the trailing dims of each head."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import rope as ref
from deepinfer.kernels.registry import op

__all__ = ["apply_rope"]


@op(reference=ref.apply_rope)
def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the last ``rd = 2 * cos.shape[-1]`` channels of every row of ``x``.

    x:    ``[N, ..., D]`` (``[N, D]`` or ``[N, H, D]``) fp32 / bf16; channels ``D - rd ..`` are
          ``rd / 2`` interleaved pairs ``(2i, 2i + 1)``; the leading ``D - rd`` pass through.
    cos, sin: ``[N, rd / 2]`` fp32, the angle of pair ``i`` at row ``n``'s position.
    inverse: rotate by the conjugate (``-angle``), used on the attention output.
    out: optional ``[N, ..., D]`` of ``x.dtype`` to write into and return; ``out=x`` is the
         in-place form: only the ``rd`` rotary channels are read and written (the passthrough
         stays where it is), bitwise the values the out-of-place call returns. Any other
         ``out`` must not overlap ``x``.
    ``(a, b) -> (a cos - b sin, a sin + b cos)`` computed in fp32, returned in ``x.dtype`` (a
    new tensor unless ``out``). Rows are independent.
    """
