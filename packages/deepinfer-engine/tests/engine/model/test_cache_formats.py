"""The cache in the model's own formats: FP8 window KV (V4: nope dims, the RoPE tail kept in the
cache dtype), FP8 / FP4 compressed entries, FP4 indexer keys. The stored rows dequantise bit
for bit to what the float cache holds (the model's rounding), the logits of chunked prefill and
decode are bitwise those of the float cache, and the bytes per token of the V4-Flash and
V4.1-Flash shapes are at most 0.55x the bf16 cache's."""

from __future__ import annotations

import pytest
import torch

import deepinfer.kernels as K
from deepinfer.engine.model.cache import ModelCache, cache_footprint, storage_formats
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.variant import variant_of
from deepinfer.engine.testing.simple_runner import SimpleRunner

from .test_config import V4_FLASH, V41  # noqa: TID252
from .test_v4_invariants import RAW as V4_RAW  # noqa: TID252
from .test_v4_invariants import random_model  # noqa: TID252
from .test_v41_invariants import RAW as V41_RAW  # noqa: TID252
from .test_v41_invariants import VOCAB as V41_VOCAB  # noqa: TID252
from .test_v41_invariants import random_v41_model  # noqa: TID252

# widths that split into the formats' blocks (the invariants tests' widths do not)
V4_PACKED = {**V4_RAW, "head_dim": 72, "index_head_dim": 32, "compress_ratios": [0, 4, 8, 4, 0]}
V41_PACKED = {**V41_RAW, "text_config": {**V41_RAW["text_config"], "index_head_dim": 32}}


def _rows(seed: int, n: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.exp(
        torch.empty(n, 1).uniform_(-12, 6, generator=g)
    )


@pytest.mark.parametrize("raw", [V4_FLASH, V41], ids=["v4-flash", "v41-flash"])
def test_formats_dequantise_to_the_model_rounding(raw):
    config = parse_config(raw)
    rounding = variant_of(config).kv_rounding(config)
    formats = storage_formats(config, torch.bfloat16)
    assert set(formats) == {"window", "kv", "index_keys"}
    x = _rows(0, 256, config.head_dim).bfloat16()
    window, kv = formats["window"], formats["kv"]
    assert torch.equal(
        K.unpack_rows(K.pack_rows(rounding.kv(x), window), window, x.dtype), rounding.kv(x)
    )
    assert torch.equal(K.unpack_rows(K.pack_rows(x, kv), kv, x.dtype), rounding.entries(x))
    keys, fmt = K.fp4_sim(_rows(1, 256, config.index_head_dim), 32), formats["index_keys"]
    assert torch.equal(K.unpack_rows(K.pack_rows(keys, fmt), fmt), keys)


def _run(model, steps, packed: bool):
    runner = SimpleRunner(model, max_seqs=2, max_len=96)
    runner.cache = ModelCache(model.config, runner.cache.layout, dtype=torch.float32, packed=packed)
    logits = [runner.step(chunks) for chunks in steps]
    return [torch.cat([out[s] for s in sorted(out)]) for out in logits], runner.cache


def packed_model_and_steps(family: str, seed: int, decodes: int):
    """A random model of ``family`` whose cache kinds all pack, and the steps of two sequences:
    two prefill chunks (the second reads ring and arena rows of the first), then ``decodes``
    single-token steps."""
    if family == "v4":
        model, vocab = random_model(V4_PACKED), V4_RAW["vocab_size"]
    else:
        model, vocab = random_v41_model(V41_PACKED), V41_VOCAB
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    steps = [{0: tokens(21), 1: tokens(6)}, {0: tokens(17), 1: tokens(30)}]
    return model, steps + [{0: tokens(1), 1: tokens(1)} for _ in range(decodes)]


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_packed_cache_runs_bitwise_like_the_float_cache(family):
    model, steps = packed_model_and_steps(family, seed=4, decodes=6)
    with torch.no_grad():
        got, packed = _run(model, steps, packed=True)
        want, plain = _run(model, steps, packed=False)
    kinds = {key.rsplit(".", 1)[1] for key in packed.formats}
    assert kinds == {"window", "kv", "index_keys"}, kinds
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for key, fmt in packed.formats.items():
        stored = K.unpack_rows(packed.tensors[key], fmt, torch.float32)
        assert torch.equal(stored, plain.tensors[key]), key
        assert plain.tensors[key].abs().sum() > 0, f"{key}: nothing was written"


@pytest.mark.parametrize("raw", [V4_FLASH, V41], ids=["v4-flash", "v41-flash"])
def test_bytes_per_token_at_most_055_of_bf16(raw):
    config = parse_config(raw)
    packed = cache_footprint(config, block_size=128)
    plain = cache_footprint(config, block_size=128, packed=False)
    assert packed.bytes_per_block <= 0.55 * plain.bytes_per_block
    assert packed.bytes_per_slot < plain.bytes_per_slot
