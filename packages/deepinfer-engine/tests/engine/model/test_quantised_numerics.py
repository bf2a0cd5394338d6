"""Quantised tiny checkpoints (FP8 block weights, FP4 experts, FP8 Engram tables) load and run,
and the numerics follow the model: by default (``numerics="model"``) the cached KV and indexer
keys are rounded as V4 / V4.1 define them in any checkpoint, and exactly the linears stored FP8 /
FP4 round their inputs; ``numerics="float"`` rounds nothing, so a quantised model then equals
the float model holding the dequantised weights."""

from __future__ import annotations

import pytest
import tokenizers
import torch

import deepinfer.kernels as K
from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config import ConfigError
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.engram_hashing import compressed_token_map
from deepinfer.engine.model.layers import Linear
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
    """Logits and, per (layer, site), the rows the rounding sites handed on (what the cache
    stores and the indexer scores, whatever the cache's storage format)."""
    sites: dict[tuple[int, str], torch.Tensor] = {}
    for layer, block in enumerate(model.layers):
        for owner in (block.attn, getattr(block.attn, "indexer", None)):
            if owner is not None and hasattr(owner, "rounding"):
                owner.rounding = _Spy(owner.rounding, layer, sites)
    return SimpleRunner(model, max_seqs=1, max_len=SEQ).step({0: ids}), sites


class _Spy:
    def __init__(self, inner, layer: int, sites: dict) -> None:
        self.inner, self.layer, self.sites = inner, layer, sites

    def _keep(self, site: str, y: torch.Tensor) -> torch.Tensor:
        self.sites[(self.layer, site)] = y.detach().clone()
        return y

    def kv(self, x):
        return self._keep("kv", self.inner.kv(x))

    def entries(self, x):
        return self._keep("entries", self.inner.entries(x))

    def index(self, x):
        return self._keep("index_k" if x.dim() == 2 else "index_q", self.inner.index(x))


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
    assert model.config.numerics == "model"


def test_inputs_are_rounded_exactly_where_the_weights_are_fp8_or_fp4(checkpoint):
    quantised, dense = _model(checkpoint), _model(checkpoint, quantization=None)
    linears = [m for m in quantised.modules() if isinstance(m, Linear)]
    assert {m.fmt for m in linears} == {"dense", "fp8", "fp4"}
    group = quantised.config.quantization.weight_block_size[1]
    for m in linears:
        assert m.act_quant_group == (None if m.fmt == "dense" else group), m
    assert all(m.act_quant_group is None for m in dense.modules() if isinstance(m, Linear))


def test_float_numerics_equal_float_model_of_dequantised_weights(checkpoint, ids):
    quantised = _model(checkpoint, numerics="float")
    dense = _model(checkpoint, quantization=None, numerics="float")
    assert dense.layers[0].attn.wq_a.weight.dtype == torch.float32
    got, _ = _run(quantised, ids)
    want, _ = _run(dense, ids)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)


def test_model_numerics_round_cached_kv_and_change_logits(checkpoint, ids):
    on, off = _model(checkpoint), _model(checkpoint, numerics="float")
    (logits_on, cache_on), (logits_off, cache_off) = _run(on, ids), _run(off, ids)
    # FP8 keeps 3 mantissa bits (~6% per value): on a random tiny model the two differ a lot
    assert torch.isfinite(logits_on[0]).all()
    assert (logits_on[0] - logits_off[0]).abs().max().item() > 1e-3
    c = on.config
    # the window rows: on the FP8 grid with the model's numerics, not with float
    for layer in range(c.num_layers):
        kv_on, kv_off = cache_on[(layer, "kv")], cache_off[(layer, "kv")]
        if c.is_v41:
            part_on, part_off, block = kv_on, kv_off, 32
        else:
            nope = c.nope_head_dim
            part_on, part_off, block = kv_on[:, :nope], kv_off[:, :nope], 64
        assert torch.equal(K.fp8_sim(part_on, block), part_on), layer
        assert not torch.equal(K.fp8_sim(part_off, block), part_off), layer
    # the indexer keys and queries: on the FP4 grid (blocks of 32), not with float
    index_sites = [k for k in cache_on if k[1].startswith("index")]
    assert {k[1] for k in index_sites} == {"index_k", "index_q"}
    for key in index_sites:
        assert torch.equal(K.fp4_sim(cache_on[key], 32), cache_on[key]), key
        assert not torch.equal(K.fp4_sim(cache_off[key], 32), cache_off[key]), key


def test_a_float_checkpoint_rounds_its_caches_but_no_linear_input(tmp_path):
    path = random_checkpoint.make_random_checkpoint(
        tmp_path, tiny_v4_config(), quantized=False, float_dtype=torch.float32
    )
    model, plain = _model(path), _model(path, numerics="float")
    assert model.config.numerics == "model"
    assert all(m.act_quant_group is None for m in model.modules() if isinstance(m, Linear))
    ids = torch.randint(0, 500, (SEQ,), generator=torch.Generator().manual_seed(8)).tolist()
    (a, cache), (b, cache_plain) = _run(model, ids), _run(plain, ids)
    assert (a[0] - b[0]).abs().max() > 1e-4
    nope = model.config.nope_head_dim
    window = cache[(0, "kv")][:, :nope]
    assert torch.equal(K.fp8_sim(window, 64), window)
    window = cache_plain[(0, "kv")][:, :nope]
    assert not torch.equal(K.fp8_sim(window, 64), window)
    # V4 index keys: Hadamard-rotated, then on the FP4 grid (blocks of 32)
    csa = model.config.compress_ratios.index(4)
    keys = cache[(csa, "index_k")]
    assert len(keys) and torch.equal(K.fp4_sim(keys, 32), keys)
    assert not torch.equal(K.fp4_sim(cache_plain[(csa, "index_k")], 32), keys)


def test_quant_simulation_is_refused_naming_its_replacement(checkpoint):
    with pytest.raises(ConfigError, match="replaced by numerics"):
        load_config(checkpoint, quant_simulation=True)
    with pytest.raises(ConfigError, match="'numerics' = 'fp8'"):
        load_config(checkpoint, numerics="fp8")
    from deepinfer.engine.frontend.llm import LLM

    with pytest.raises(TypeError, match="'quant_simulation' was replaced by numerics"):
        LLM(str(checkpoint), quant_simulation=False)  # refused before anything loads
