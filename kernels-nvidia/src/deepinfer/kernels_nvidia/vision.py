"""Vision-tower attention on NVIDIA GPUs: PyTorch's fused scaled-dot-product attention (flash
or memory-efficient kernels) over one image's patches, instead of the reference's N x N fp32
score matrix (4.8 GB per layer for a 1024-token image)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels_nvidia.registry import implements


@implements("vision_attention")
def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"vision_attention: q, k, v must be [N, H, d] of one shape; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    return out.transpose(0, 1).contiguous()
