"""A transformers state dict (in-memory module names or ``save_pretrained`` names) in official
checkpoint names, fused experts split per expert. The name mapping itself is the checkpoint
loader's (:mod:`deepinfer.engine.checkpoint.names`); this only applies it to tensors in memory."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer.engine.checkpoint.names import is_fused_experts, official_name, split_fused_experts


def from_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert a whole transformers state dict to official names (experts split)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        official = official_name(name)
        if not is_fused_experts(official):
            out[official] = tensor
            continue
        for expert_name, part, _shape in split_fused_experts(official, tuple(tensor.shape)):
            out[expert_name] = tensor[part.expert, part.row_start : part.row_end]
    return out
