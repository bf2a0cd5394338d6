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
    # [1, H, N, d]: the fused kernels take 4-D inputs only (3-D falls back to the math path)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.squeeze(0).transpose(0, 1).contiguous()
