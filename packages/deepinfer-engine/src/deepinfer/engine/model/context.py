"""What one forward step hands down to every module: metadata, cache, RoPE angles."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import AttentionMetadata
from deepinfer.engine.model.rope import RopeTables


@dataclass
class StepContext:
    """Per-step state passed explicitly through the stack (never a global).

    angles: ``{compressed_table: (cos, sin)}`` ``[T, rd/2]`` at the token positions.
    selected: V4.1 top-k lists of the latest index-source layer (``layer -> [T, k]``), and
    candidate_mask its candidate pre-filter ``[T, C]`` bool; filled as layers run.
    """

    metadata: AttentionMetadata
    cache: ModelCache
    input_ids: torch.Tensor
    positions: torch.Tensor
    rope: RopeTables
    angles: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_mask: torch.Tensor | None = None

    def entry_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the compressed table at compressed-entry positions."""
        return RopeTables.angles(self.rope.compress, positions)
