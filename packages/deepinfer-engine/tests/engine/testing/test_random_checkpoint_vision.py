"""``make_random_checkpoint(..., vision=...)`` adds, keeps or drops the V4.1 vision tower."""

import json

import pytest
import torch

from deepinfer.engine.checkpoint.index import read_checkpoint_index
from deepinfer.engine.checkpoint.model_loader import load_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config


def test_vision_true_adds_a_tiny_tower_that_loads(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v41_config(vision=False), quantized=False, vision=True)
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]["hidden_size"] == 32
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    assert model.has_vision and model.image_start.abs().sum() > 0
    assert model.vision.blocks[0].attn.wqkv.bias.abs().sum() > 0  # random, not the zero fill


def test_vision_false_drops_it(tmp_path):
    make_random_checkpoint(
        tmp_path, tiny_v41_config(), quantized=True, vision=False, tokenizer=False
    )
    assert "vision_config" not in json.loads((tmp_path / "config.json").read_text())
    names = read_checkpoint_index(tmp_path)
    assert not [n for n in names if n.startswith(("vision.", "aligner.", "image_"))]


def test_vision_needs_a_v41_config(tmp_path):
    with pytest.raises(ValueError, match="only V4.1 checkpoints"):
        make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=False, vision=True)
