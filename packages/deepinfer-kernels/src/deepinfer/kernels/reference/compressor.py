"""Reference softmax pooling of compressor windows."""

from __future__ import annotations

import torch


def compress_pool(
    kv: torch.Tensor, score: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    weights = torch.softmax(score.float(), dim=1)
    return (weights * kv.float()).sum(dim=1).to(out_dtype)
