"""Reference interleaved partial RoPE."""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    keep = x.shape[-1] - rope_dim
    pairs = x[..., keep:].float().unflatten(-1, (-1, 2))
    extra = x.dim() - cos.dim()
    c = cos.float().reshape(cos.shape[0], *([1] * extra), cos.shape[-1])
    s = sin.float().reshape(sin.shape[0], *([1] * extra), sin.shape[-1])
    if inverse:
        s = -s
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    if out is None:
        return torch.cat((x[..., :keep], rotated.to(x.dtype)), dim=-1)
    if not same_view(out, x):
        out[..., :keep].copy_(x[..., :keep])
    out[..., keep:].copy_(rotated)
    return out


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same elements (``out=x``: the in-place form)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    )
