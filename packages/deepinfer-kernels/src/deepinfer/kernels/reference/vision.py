"""Reference twins of the vision-tower ops: full attention over one image, rotate-half 2D
RoPE, the aligner's patch unfold, GELU and the SwiGLU product."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, N, d]
    probs = torch.softmax(qf @ kf.transpose(1, 2) * scale, dim=-1)
    return (probs @ vf).transpose(0, 1).to(q.dtype)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def patch_unfold(x: torch.Tensor, n_h: int, n_w: int, ratio: int) -> torch.Tensor:
    grid = x.reshape(n_h, n_w, -1).permute(2, 0, 1)  # [C, n_h, n_w]
    grid = F.pad(grid, (0, -n_w % ratio, 0, -n_h % ratio))
    return F.unfold(grid.unsqueeze(0), ratio, stride=ratio).squeeze(0).transpose(0, 1)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float()).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
