"""What the V4.1 stack adds for images: the tower, the aligner and the span vectors, the encoder
of one image, and the step's image rows.

The runner encodes each image once (:meth:`VisionModel.encode_image`, when the prefill chunk
holding its span is scheduled: a span is never split across chunks) and hands the step its
image rows and their embeddings on the :class:`ForwardBatch`; the stack puts them in place of
the token embeddings, routes those rows with ``gate.bias_vl`` and makes them Engram barriers.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.vision import Aligner, VisionTower, image_span
from deepinfer.engine.model.vision_config import ImageSettings, VisionConfig

SPAN_VECTORS = ("image_start", "image_end", "image_newline")


class VisionModel:
    """Mixin of :class:`~deepinfer.engine.model.model_v41.DeepseekV41Model`."""

    vision_config: VisionConfig | None

    def build_vision(self, dtype: torch.dtype, device) -> None:
        """Build ``vision``, ``aligner`` and the span vectors when the config has a tower."""
        raw = self.config.vision_config
        self.vision_config = VisionConfig.from_raw(raw) if raw else None
        if self.vision_config is None:
            return
        dim = self.config.hidden_size
        self.vision = VisionTower(self.vision_config, dtype, device)
        self.aligner = Aligner(self.vision_config, dim, dtype, device)
        for name in SPAN_VECTORS:
            empty = torch.empty(dim, dtype=dtype, device=device)
            setattr(self, name, nn.Parameter(empty, requires_grad=False))

    @property
    def has_vision(self) -> bool:
        return self.vision_config is not None

    def encode_image(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """One image's span embeddings ``[grid_h * (grid_w + 1) + 2, D]`` from its patches
        ``[vit_h * vit_w, 3 p p]`` (any float dtype, any device)."""
        if self.vision_config is None:
            raise RuntimeError("this model has no vision tower (config.json has no vision_config)")
        ratio = self.vision_config.downsample_ratio
        rows = self.aligner(self.vision(patches, vit_h, vit_w), vit_h, vit_w)
        grid_h, grid_w = -(-vit_h // ratio), -(-vit_w // ratio)
        return image_span(
            rows, grid_h, grid_w, self.image_start, self.image_newline, self.image_end
        )

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        h = super().embed_tokens(batch)
        if batch.image_rows is None:
            return h
        return h.index_copy(0, batch.image_rows, batch.image_embeds.to(h.dtype))

    @staticmethod
    def image_mask(batch: ForwardBatch) -> torch.Tensor | None:
        """``[T]`` bool, True on the step's image-span rows (None: the step has no image)."""
        if batch.image_rows is None:
            return None
        mask = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=batch.input_ids.device)
        return mask.index_fill_(0, batch.image_rows, True)


def image_settings(model: nn.Module) -> ImageSettings | None:
    """The frontend's image settings of a loaded model (None: no tower)."""
    vision = getattr(model, "vision_config", None)
    token_id = getattr(model.config, "image_token_id", None)
    if vision is None or token_id is None:
        return None
    return ImageSettings(vision, int(token_id))
