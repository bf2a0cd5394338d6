"""Real-format tiny checkpoints load into the model (``build_model``) and run a forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer.engine.checkpoint import load_into, read_tensors
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner

HAS_V41_MODEL = importlib.util.find_spec("deepinfer.engine.model.model_v41") is not None
CONFIGS = [
    pytest.param(tiny_v4_config(), id="v4"),
    pytest.param(
        tiny_v41_config(),
        id="v41",
        marks=pytest.mark.skipif(not HAS_V41_MODEL, reason="V4.1 model not built yet"),
    ),
]


def _bind_engram(model, directory) -> None:
    """V4.1 hashes n-grams of compressed token ids: give the model the tokenizer's map."""
    if not model.config.engram_layer_ids:
        return
    from deepinfer.engine.model.engram_hashing import compressed_token_map
    from deepinfer.engine.tokenizer.tokenizer import load_tokenizer

    model.bind_engram(compressed_token_map(load_tokenizer(directory).backend))


def _forward(model, tokens):
    runner = SimpleRunner(model, max_seqs=1, max_len=len(tokens) + 1)
    return runner.step({0: tokens})[0]


@pytest.mark.parametrize("raw", CONFIGS)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantised"])
def test_checkpoint_loads_into_the_model_and_runs(tmp_path, raw, quantized):
    make_random_checkpoint(tmp_path, raw, quantized=quantized, seed=9)
    config = load_config(tmp_path)
    model = build_model(config, device="cpu", dtype=torch.float32)
    report = load_into(model, tmp_path, progress=False)
    _bind_engram(model, tmp_path)
    stored = read_tensors(tmp_path, list(model.state_dict()))
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.dtype.itemsize > 1:
            assert torch.equal(t, stored[name].to(t.dtype)), name
        else:
            assert torch.equal(t.view(torch.uint8), stored[name].to(t.dtype).view(torch.uint8))
    assert report.loaded == len(model.state_dict())
    tokens = list(range(3, 40))
    logits = _forward(model, tokens)
    assert logits.shape == (len(tokens), config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0
    # the same weights through the dummy path give a different model: the load mattered
    dummy = build_model(config, device="cpu", dtype=torch.float32)
    load_into(dummy, None, load_format="dummy", seed=9)
    _bind_engram(dummy, tmp_path)
    assert not torch.allclose(_forward(dummy, tokens), logits)


@pytest.mark.parametrize("raw", CONFIGS)
def test_load_model_numerics_default_to_the_model_and_float_is_a_switch(tmp_path, raw):
    from deepinfer.engine.checkpoint import load_model

    tokens = list(range(3, 30))
    quantised = make_random_checkpoint(tmp_path / "q", raw, quantized=True, seed=4)
    plain = make_random_checkpoint(tmp_path / "f", raw, quantized=False, seed=4)
    reference = load_model(quantised, dtype=torch.float32, progress=False)
    assert reference.config.numerics == "model"
    assert load_model(plain, dtype=torch.float32, progress=False).config.numerics == "model"
    loose = load_model(quantised, dtype=torch.float32, numerics="float", progress=False)
    assert loose.config.numerics == "float"
    for a, b in zip(reference.state_dict().values(), loose.state_dict().values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # same weights
    rounded, unrounded = _forward(reference, tokens), _forward(loose, tokens)
    assert torch.isfinite(rounded).all()
    # the model's numerics round activations and caches: close, not equal
    assert not torch.equal(rounded, unrounded)
    relative = ((rounded - unrounded).norm() / rounded.norm()).item()
    assert relative < 0.5
    dummy = load_model(quantised, load_format="dummy", dtype=torch.float32, progress=False)
    assert torch.isfinite(_forward(dummy, tokens)).all()
