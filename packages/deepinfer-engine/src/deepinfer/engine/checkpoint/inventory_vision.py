"""Inventory entries of the V4.1 vision tower and aligner (spec deepseek-v4.md section 7.4).

Names and shapes follow public tensor lists of the released checkpoint (``vision.patch_embed``,
``vision.blocks.{i}``, ``vision.norm``, ``aligner.w1/w2``, ``image_start/end/newline``);
``image_pad`` appears in only some lists and is optional (no model reads it). The specs are
marked ``skip``: the loader fills them when the model has the tower (built whenever the config
has a ``vision_config``) and skips them for a model built without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer.engine.checkpoint.index import CheckpointError
from deepinfer.engine.checkpoint.inventory_builder import BF16, InventoryBuilder
from deepinfer.engine.model.vision_config import ImageSettings, VisionConfig
from deepinfer.engine.model.vision_model import image_settings


def add_vision(inv: InventoryBuilder) -> None:
    """The V4.1 ViT and aligner (spec 7.4)."""
    c = inv.config
    v = c.vision_config or {}
    dim, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    patch, down = int(v["patch_size"]), int(v.get("downsample_ratio", 3))
    hidden = c.hidden_size

    def add(name: str, shape: tuple[int, ...], **kw) -> None:
        inv.add(name, shape, BF16, skip=True, **kw)

    add("vision.patch_embed.proj.weight", (dim, 3 * patch * patch))
    add("vision.patch_embed.proj.bias", (dim,))
    for b in range(int(v["num_hidden_layers"])):
        p = f"vision.blocks.{b}"
        add(f"{p}.norm1.weight", (dim,))
        add(f"{p}.norm2.weight", (dim,))
        add(f"{p}.attn.wqkv.weight", (3 * dim, dim))
        add(f"{p}.attn.wqkv.bias", (3 * dim,))
        add(f"{p}.attn.wo.weight", (dim, dim))
        add(f"{p}.attn.wo.bias", (dim,))
        add(f"{p}.mlp.w1.weight", (2 * inter, dim))
        add(f"{p}.mlp.w2.weight", (dim, inter))
    add("vision.norm.weight", (dim,))
    add("aligner.w1.weight", (hidden, dim * down * down))
    add("aligner.w1.bias", (hidden,))
    add("aligner.w2.weight", (hidden, hidden))
    add("aligner.w2.bias", (hidden,))
    for name in ("image_start", "image_end", "image_newline"):
        add(name, (hidden,))
    add("image_pad", (hidden,), optional=True, unused="image_pad: no model reads it")


# What our preprocessing does (frontend/images.py); a checkpoint asking for anything else is
# refused rather than fed differently prepared pixels.
_FIXED_PREPROCESSING = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,  # PIL bicubic
    "pad_value": 127,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}


def check_image_processor(directory: str | Path, vision: VisionConfig) -> None:
    """Check ``preprocessor_config.json`` (when the checkpoint has one) against the vision
    config and the preprocessing we implement; raise :class:`CheckpointError` naming the field."""
    path = Path(directory) / "preprocessor_config.json"
    if not path.is_file():
        return
    raw = json.loads(path.read_text(encoding="utf-8"))
    size = raw.get("size") or {}
    expected = {
        **_FIXED_PREPROCESSING,
        "rescale_factor": 1 / 255,
        "patch_size": vision.patch_size,
        "downsample_ratio": vision.downsample_ratio,
        "max_wh_ratio": vision.max_wh_ratio,
        "min_pixels": vision.min_pixels,
        "max_image_tokens": vision.max_image_tokens,
    }
    found = dict(raw)
    found.setdefault("min_pixels", size.get("shortest_edge", vision.min_pixels))
    found.setdefault("max_image_tokens", size.get("longest_edge", vision.max_image_tokens))
    for name, want in expected.items():
        if name not in found:
            continue
        got = found[name]
        same = got == want if not isinstance(want, float) else abs(got - want) < 1e-9
        if not same:
            raise CheckpointError(
                f"{path}: {name}={got!r}, expected {want!r} (the vision_config of config.json and "
                "the image preprocessing this engine implements)"
            )


def checked_image_settings(model: Any, directory: str | Path) -> ImageSettings | None:
    """The frontend's image settings of a loaded model, its checkpoint's image processor
    checked first (None: the model has no tower)."""
    settings = image_settings(model)
    if settings is not None:
        check_image_processor(directory, settings.config)
    return settings
