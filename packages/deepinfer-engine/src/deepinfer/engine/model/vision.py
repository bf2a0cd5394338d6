"""The V4.1 vision tower and aligner (spec deepseek-v4.md section 7.4).

One image at a time: ``patches [n_h * n_w, 3 * p * p]`` (row-major patches, each flattened
channel-major) -> ``patch_embed`` -> ``num_layers`` pre-norm blocks (full attention over the
image's patches with 2D RoPE, SwiGLU MLP) -> ``norm`` -> aligner (``r x r`` unfold, ``w1``, GELU,
``w2``) -> one text-width row per aligner cell. :func:`image_span` lays the rows out as the
image's span in the text (``image_start``, rows each closed by ``image_newline``,
``image_end``).

2D RoPE: each head of ``d`` channels is split in halves paired rotate-half style (channel ``i``
with ``i + d/2``); the ``d/2`` angles are the patch row times ``d/4`` frequencies, then the patch
column times the same frequencies (``theta ** (-2j / (d/2))``).

Parameter names are the checkpoint's (``vision.*``, ``aligner.*``), in the model dtype (the
norms compute in fp32 from the stored bf16 weights, as the reference's fp32 copies of them do).
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.vision_config import VisionConfig


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class BiasedLinear(nn.Module):
    """``y = x W^T (+ b)``: a dense linear, ``weight [out, in]``, optional ``bias [out]``."""

    def __init__(self, inp: int, out: int, *, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _param((out, inp), dtype, device)
        self.bias = _param((out,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = K.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class VisionNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig, dtype, device) -> None:
        super().__init__()
        self.proj = BiasedLinear(c.patch_dim, c.hidden_size, bias=True, dtype=dtype, device=device)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig, dtype, device) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        dim = c.hidden_size
        self.wqkv = BiasedLinear(dim, 3 * dim, bias=True, dtype=dtype, device=device)
        self.wo = BiasedLinear(dim, dim, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = K.rope_rotate_half(q, cos, sin), K.rope_rotate_half(k, cos, sin)
        return self.wo(K.vision_attention(q, k, v).reshape(n, -1))


class VisionMLP(nn.Module):
    """``w2(silu(gate) * up)`` with ``w1`` the fused ``[gate | up]`` projection, no biases."""

    def __init__(self, c: VisionConfig, dtype, device) -> None:
        super().__init__()
        dim, inter = c.hidden_size, c.intermediate_size
        self.w1 = BiasedLinear(dim, 2 * inter, bias=False, dtype=dtype, device=device)
        self.w2 = BiasedLinear(inter, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(K.silu_mul(gate, up))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig, dtype, device) -> None:
        super().__init__()
        self.norm1 = VisionNorm(c.hidden_size, c.norm_eps, dtype, device)
        self.attn = VisionAttention(c, dtype, device)
        self.norm2 = VisionNorm(c.hidden_size, c.norm_eps, dtype, device)
        self.mlp = VisionMLP(c, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def rope_angles_2d(
    n_h: int, n_w: int, head_dim: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[n_h * n_w, head_dim / 2]`` fp32 of the row-major patch grid."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    rows = torch.arange(n_h, device=device, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, device=device, dtype=torch.float32).repeat(n_h)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    return angles.cos(), angles.sin()


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig, dtype=torch.bfloat16, device=None) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(c, dtype, device) for _ in range(c.num_layers))
        self.norm = VisionNorm(c.hidden_size, c.norm_eps, dtype, device)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches ``[n_h * n_w, 3 p p]`` -> features ``[n_h * n_w, hidden]``."""
        if patches.shape != (n_h * n_w, self.config.patch_dim):
            raise ValueError(
                f"patches of shape {tuple(patches.shape)}: expected "
                f"({n_h * n_w}, {self.config.patch_dim}) for a {n_h}x{n_w} grid"
            )
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(patches.to(weight.device, weight.dtype))
        c = self.config
        cos, sin = rope_angles_2d(n_h, n_w, c.head_dim, c.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """``r x r`` patch blocks -> one text-width row each: ``w2(gelu(w1(unfold(x))))``."""

    def __init__(self, c: VisionConfig, text_dim: int, dtype=torch.bfloat16, device=None) -> None:
        super().__init__()
        self.ratio = c.downsample_ratio
        inp = c.hidden_size * self.ratio**2
        self.w1 = BiasedLinear(inp, text_dim, bias=True, dtype=dtype, device=device)
        self.w2 = BiasedLinear(text_dim, text_dim, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """features ``[n_h * n_w, hidden]`` -> ``[ceil(n_h/r) * ceil(n_w/r), text_dim]``."""
        return self.w2(K.gelu(self.w1(K.patch_unfold(x, n_h, n_w, self.ratio))))


def image_span(
    rows: torch.Tensor,
    grid_h: int,
    grid_w: int,
    start: torch.Tensor,
    newline: torch.Tensor,
    end: torch.Tensor,
) -> torch.Tensor:
    """The span embeddings ``[grid_h * (grid_w + 1) + 2, D]``: ``start``, each row of the
    aligner grid followed by ``newline``, ``end``."""
    dim = rows.shape[-1]
    grid = rows.view(grid_h, grid_w, dim)
    closed = torch.cat([grid, newline.to(rows.dtype).expand(grid_h, 1, dim)], dim=1)
    return torch.cat(
        [start.to(rows.dtype)[None], closed.reshape(-1, dim), end.to(rows.dtype)[None]]
    )
