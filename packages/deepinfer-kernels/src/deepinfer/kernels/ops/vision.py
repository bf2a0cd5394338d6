"""The vision tower's ops (spec deepseek-v4.md section 7.4): attention over one image's
patches, its 2D RoPE, the aligner's ``r x r`` patch unfold, and the MLP activations."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import vision as ref
from deepinfer.kernels.registry import op

__all__ = ["vision_attention", "rope_rotate_half", "patch_unfold", "gelu", "silu_mul"]


@op(reference=ref.vision_attention)
def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full bidirectional attention over the patches of one image, no mask, no sink.

    q, k, v: ``[N, H, d]`` (N patches, H heads), one float dtype.
    ``out[n, h] = sum_m softmax_m(q[n, h] . k[m, h] / sqrt(d)) v[m, h]``, logits and softmax in
    fp32, the sum accumulated in fp32 (a backend may round the probabilities to ``q.dtype``
    before the product, as flash attention does). Returns ``[N, H, d]`` of ``q.dtype``.
    """


@op(reference=ref.rope_rotate_half)
def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: channel ``i`` pairs with ``i + d/2``.

    x: ``[N, H, d]``; cos, sin: ``[N, d/2]`` (one angle per pair, shared by the heads).
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32, rounded once to ``x.dtype``.
    """


@op(reference=ref.patch_unfold)
def patch_unfold(x: torch.Tensor, n_h: int, n_w: int, ratio: int) -> torch.Tensor:
    """Fold each ``ratio x ratio`` block of an ``n_h x n_w`` patch grid into one row.

    x: ``[n_h * n_w, C]`` row-major patch features. The grid is zero-padded at the bottom
    and right to multiples of ``ratio``. Returns ``[ceil(n_h/r) * ceil(n_w/r), C * r * r]``
    of ``x.dtype``: rows over the blocks in row-major order, each row channel-major, then
    block row, then block column (``torch.nn.functional.unfold``'s order).
    """


@op(reference=ref.gelu)
def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, computed in fp32, returned in ``x.dtype``; any shape."""


@op(reference=ref.silu_mul)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, returned in ``gate.dtype``; gate and up the same shape."""
