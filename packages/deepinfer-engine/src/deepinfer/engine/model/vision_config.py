"""The V4.1 vision tower's configuration and the image-size plan (torch-free).

Spec deepseek-v4.md section 7.4. ``VisionConfig.from_raw`` reads ``config.json``'s
``vision_config``; :func:`plan_image` is the resize plan the checkpoint's image processor
applies (upscale to ``min_pixels``, round up to whole patches, shrink until the image costs at
most ``max_image_tokens`` text positions), so the frontend knows an image's span length from its
size alone, before decoding it.

One image of ``n_h x n_w`` ViT patches becomes ``ceil(n_h/r) x ceil(n_w/r)`` aligner rows
(``r = downsample_ratio``); its span in the text is ``image_start``, then each aligner row
followed by ``image_newline``, then ``image_end``: ``gh * (gw + 1) + 2`` positions, every one
carrying ``image_token_id``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The released tower; like transformers' DeepseekV41VisionConfig, an absent field takes these.
_DEFAULTS = {
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
}


@dataclass(frozen=True)
class VisionConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    norm_eps: float = 1e-6

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> VisionConfig:
        raw = {**_DEFAULTS, **raw}
        config = cls(
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=int(raw["hidden_size"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            patch_size=int(raw["patch_size"]),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            downsample_ratio=int(raw.get("downsample_ratio", 3)),
            max_image_tokens=int(raw.get("max_image_tokens", 1024)),
            min_pixels=int(raw.get("min_pixels", 295936)),
            max_wh_ratio=raw.get("max_wh_ratio"),
        )
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "patch_size", "downsample_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config: {name}={getattr(self, name)}, expected > 0")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision_config: hidden_size={self.hidden_size} over num_attention_heads="
                f"{self.num_heads} must give a head size divisible by 4 (2D RoPE)"
            )
        if self.min_pixels <= 0 or self.max_image_tokens < 4:
            raise ValueError(
                f"vision_config: min_pixels={self.min_pixels} (expected > 0), max_image_tokens="
                f"{self.max_image_tokens} (expected >= 4)"
            )
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ValueError(f"vision_config: max_wh_ratio={self.max_wh_ratio}, expected > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


@dataclass(frozen=True)
class ImageSettings:
    """What the frontend needs of a model with a tower: its config and placeholder token."""

    config: VisionConfig
    image_token_id: int


def span_length(grid_h: int, grid_w: int) -> int:
    """Text positions of an image whose aligner grid is ``grid_h x grid_w``."""
    return grid_h * (grid_w + 1) + 2


@dataclass(frozen=True)
class ImagePlan:
    """The pixel box an image is resized and padded to, and what it costs.

    height, width: multiples of the patch size; vit_h, vit_w: the patch grid; grid_h, grid_w:
    the aligner grid; num_tokens: the span length in the text.
    """

    height: int
    width: int
    vit_h: int
    vit_w: int
    grid_h: int
    grid_w: int

    @property
    def num_tokens(self) -> int:
        return span_length(self.grid_h, self.grid_w)

    @property
    def num_patches(self) -> int:
        return self.vit_h * self.vit_w


def _aligner_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    return -(-(height // patch) // ratio), -(-(width // patch) // ratio)


def _fit_to_budget(height: float, width: float, patch: int, ratio: int, budget: int):
    """The largest aspect-preserving box whose span fits ``budget`` (closed form: the span of
    a ``w x h/w*w`` grid is about ``w * (w + 1) * h/w``; solve for ``w``)."""
    aspect = height / width
    grid_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    grid_h = grid_w * aspect
    cell = patch * ratio
    if grid_w < 1.0:  # taller than one column allows
        return (budget - 2) // 2 * cell, cell
    if grid_h < 1.0:  # wider than one row allows
        return cell, (budget - 3) * cell
    scale = min(math.floor(grid_w) * cell / width, math.floor(grid_h) * cell / height)
    return (
        math.floor(height * scale / patch) * patch,
        math.floor(width * scale / patch) * patch,
    )


def plan_image(width: int, height: int, config: VisionConfig) -> ImagePlan:
    """The resize plan of an image of ``width x height`` pixels (both > 0)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height}: expected both sides > 0")
    patch, ratio = config.patch_size, config.downsample_ratio
    w, h = float(width), float(height)
    if config.max_wh_ratio is not None and w > h * config.max_wh_ratio:
        w = h * config.max_wh_ratio
    if w * h < config.min_pixels:
        grow = (config.min_pixels / (w * h)) ** 0.5
        w, h = int(w * grow), int(h * grow)
    box_w, box_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    grid_h, grid_w = _aligner_grid(box_h, box_w, patch, ratio)
    if span_length(grid_h, grid_w) > config.max_image_tokens:
        box_h, box_w = _fit_to_budget(h, w, patch, ratio, config.max_image_tokens)
        grid_h, grid_w = _aligner_grid(box_h, box_w, patch, ratio)
        if span_length(grid_h, grid_w) > config.max_image_tokens:
            raise ValueError(
                f"image size {width}x{height}: no resize fits it in max_image_tokens="
                f"{config.max_image_tokens}"
            )
    return ImagePlan(box_h, box_w, box_h // patch, box_w // patch, grid_h, grid_w)


def fitted_size(height: int, width: int, box_h: int, box_w: int) -> tuple[int, int]:
    """(height, width) of the image scaled to fit the box, aspect kept: one side exact, the
    other rounded (what ``PIL.ImageOps.contain`` gives)."""
    image_ratio, box_ratio = width / height, box_w / box_h
    if image_ratio > box_ratio:
        return round(height / width * box_w), box_w
    if image_ratio < box_ratio:
        return box_h, round(width / height * box_h)
    return box_h, box_w
