"""The tiny vision tower of the test checkpoints (its own module: ``configs`` and
``random_checkpoint`` both use it)."""

from __future__ import annotations

from typing import Any


def tiny_vision_config() -> dict[str, Any]:
    """A one-block vision tower (width 32, 2 heads, patch 14) whose images cost 5 to 16
    text positions (``min_pixels`` 28 x 28, ``max_image_tokens`` 16)."""
    return {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 48,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 16,
        "min_pixels": 784,
        "max_wh_ratio": None,
    }
