"""Quantised tiny checkpoints (FP8 block weights, FP4 experts, FP8 Engram tables) load and run,
and the reference-numerics switch changes exactly what it should: with it off a quantised model
equals the float model holding the dequantised weights; with it on, the activations feeding
quantised linears and the cached KV are rounded as the reference rounds them."""

from __future__ import annotations

import pytest
import tokenizers
import torch

import deepinfer.kernels as K
from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.engram_hashing import compressed_token_map
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import random_checkpoint
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner

SEQ = 36


def _model(path, **overrides):
    config = load_config(path, **overrides)
    model = build_model(config, device="cpu", dtype=torch.float32)
    # validate against the checkpoint's own config; a dense module gets dequantised weights
    load_into(model, path, config=load_config(path), progress=False)
    if config.engram_layer_ids:
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        model.bind_engram(compressed_token_map(tokenizer))
    return model.eval()


def _run(model, ids):
    runner = SimpleRunner(model, max_seqs=1, max_len=SEQ)
    return runner.step({0: ids}), runner.cache


@pytest.fixture(scope="module", params=["v4", "v41"])
def checkpoint(request, tmp_path_factory):
    raw = tiny_v4_config() if request.param == "v4" else tiny_v41_config(vision=False)
    path = tmp_path_factory.mktemp(request.param)
    return random_checkpoint.make_random_checkpoint(
        path, raw, quantized=True, float_dtype=torch.float32
    )


@pytest.fixture(scope="module")
def ids(checkpoint):
    vocab = load_config(checkpoint).vocab_size
    return torch.randint(0, vocab, (SEQ,), generator=torch.Generator().manual_seed(4)).tolist()


def test_quantised_checkpoint_stores_quantised_weights(checkpoint):
    model = _model(checkpoint)
    weights = dict(model.named_parameters())
    assert weights["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert weights["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert weights["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # packed FP4
    assert model.config.quant_simulation


def test_simulation_off_equals_float_model_of_dequantised_weights(checkpoint, ids):
    quantised = _model(checkpoint, quant_simulation=False)
    dense = _model(checkpoint, quantization=None, quant_simulation=False)
    assert dense.layers[0].attn.wq_a.weight.dtype == torch.float32
    got, _ = _run(quantised, ids)
    want, _ = _run(dense, ids)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)


def test_simulation_on_rounds_cached_kv_and_changes_logits(checkpoint, ids):
    on, off = _model(checkpoint), _model(checkpoint, quant_simulation=False)
    (logits_on, cache_on), (logits_off, cache_off) = _run(on, ids), _run(off, ids)
    # FP8 keeps 3 mantissa bits (~6% per value): on a random tiny model the two differ a lot
    assert torch.isfinite(logits_on[0]).all()
    assert (logits_on[0] - logits_off[0]).abs().max().item() > 1e-3
    c = on.config
    # the window rows of the sequence (slot 0): on the FP8 grid with the switch on, not off
    rows = slice(0, min(SEQ, cache_on.ring_size))
    for layer in range(c.num_layers):
        sim_on = cache_on[f"{layer}.window"][rows]
        sim_off = cache_off[f"{layer}.window"][rows]
        if c.is_v41:
            part_on, part_off, block = sim_on, sim_off, 32
        else:
            part_on, part_off, block = (
                sim_on[:, : c.nope_head_dim],
                sim_off[:, : c.nope_head_dim],
                64,
            )
        assert torch.equal(K.fp8_sim(part_on, block), part_on), layer
        assert not torch.equal(K.fp8_sim(part_off, block), part_off), layer


def test_override_turns_reference_numerics_on_for_a_float_checkpoint(tmp_path):
    path = random_checkpoint.make_random_checkpoint(
        tmp_path, tiny_v4_config(), quantized=False, float_dtype=torch.float32
    )
    plain, simulated = _model(path), _model(path, quant_simulation=True)
    assert not plain.config.quant_simulation
    ids = torch.randint(0, 500, (SEQ,), generator=torch.Generator().manual_seed(8)).tolist()
    (a, cache_plain), (b, cache_sim) = _run(plain, ids), _run(simulated, ids)
    assert (a[0] - b[0]).abs().max() > 1e-4
    nope = plain.config.nope_head_dim
    window = cache_sim["0.window"][:SEQ, :nope]
    assert torch.equal(K.fp8_sim(window, 64), window)
    window = cache_plain["0.window"][:SEQ, :nope]
    assert not torch.equal(K.fp8_sim(window, 64), window)
