"""Reference interleaved partial RoPE."""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    xf = x.float()
    pairs = xf[..., -rope_dim:].unflatten(-1, (-1, 2))
    extra = x.dim() - cos.dim()
    c = cos.float().reshape(cos.shape[0], *([1] * extra), cos.shape[-1])
    s = sin.float().reshape(sin.shape[0], *([1] * extra), sin.shape[-1])
    if inverse:
        s = -s
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((xf[..., :-rope_dim], rotated), dim=-1).to(x.dtype)
