"""The model's parameters are the checkpoint inventory: ``expected_tensors`` (the state dict of
a meta-device model) equals the loader's independent ``official_inventory`` name for name,
shape and dtype, for V4 / V4.1, quantised or not, with and without the draft stages."""

from __future__ import annotations

import pytest

from deepinfer.engine.checkpoint import official_inventory
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model, expected_tensors
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.writer import with_quantization

CONFIGS = {
    "v4": tiny_v4_config(),
    "v4-0731-dspark": tiny_v4_config(
        compress_ratios=[0, 4, 128, 4, 0, 0, 0],
        dspark_block_size=3,
        dspark_noise_token_id=5,
        dspark_target_layer_ids=[1, 2, 3],
        dspark_markov_rank=32,
    ),
    "v41": tiny_v41_config(vision=False),
    "v41-vision": tiny_v41_config(),
}


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantised"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_is_the_official_inventory(name, quantized):
    config = parse_config(with_quantization(CONFIGS[name], quantized))
    ours = expected_tensors(config)
    inventory = {k: s for k, s in official_inventory(config).items() if not s.unused}
    theirs = {k: (tuple(s.shape), s.dtype) for k, s in inventory.items()}
    required = {k for k, s in inventory.items() if not s.optional}
    assert sorted(required - set(ours)) == []
    assert sorted(set(ours) - set(theirs)) == []  # optional ones (draft bias_vl) may be built
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}


def test_text_only_model_has_no_draft_stages():
    config = parse_config(CONFIGS["v41"])
    names = build_model(config, device="meta").state_dict()
    assert not any(k.startswith("mtp.") for k in names)
    assert any(k.startswith("mtp.") for k in expected_tensors(config))
