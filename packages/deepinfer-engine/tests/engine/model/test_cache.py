"""Cache layout: which layers own arena storage, state ring sizes, and the footprint numbers
the engine sizes its memory from (checked against the spec's arithmetic, section 3)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache, cache_footprint
from deepinfer.engine.model.config_parsing import parse_config

from .test_config import V4_FLASH, V41  # noqa: TID252


def test_v4_flash_bytes_per_token_match_spec():
    c = parse_config(V4_FLASH)
    fp = cache_footprint(c, block_size=128, packed=False)
    # spec 3: CSA (512 + 128) / 4 x 2 B = 320 B/token, HCA 512 / 128 x 2 = 8 B/token
    assert fp.bytes_per_block == 128 * (21 * 320 + 20 * 8)
    window = 43 * 128 * 512 * 2
    csa_state = 21 * (2 * 8 * 1024 + 2 * 8 * 256) * 4
    hca_state = 20 * 2 * 128 * 512 * 4
    assert fp.bytes_per_slot == window + csa_state + hca_state
    # the model's formats: a KV row is 448 FP8 + 7 scale bytes + 64 bf16 (592 aligned), an
    # index key 64 FP4 bytes + 4 scale bytes (80 aligned)
    packed = cache_footprint(c, block_size=128)
    assert packed.bytes_per_block == 128 * 21 * (592 + 80) // 4 + 20 * 592
    assert packed.bytes_per_slot == 43 * 128 * 592 + csa_state + hca_state


def test_v41_only_kv_sources_own_arena_storage():
    c = parse_config(V41)
    cache = ModelCache(c, CacheLayout(num_blocks=2, num_slots=1), device="meta")
    owners = sorted({int(k.split(".")[0]) for k in cache.tensors if cache.is_arena(k)})
    assert owners == [2, 8, 14, 20]
    # FP4 latents: 256 code bytes + 32 e4m3 scales; FP4 index keys 64 + 4 (aligned to 80)
    assert cache["2.kv"].shape == (2 * 64, 288) and cache["20.kv"].shape == (2 * 128, 288)
    assert cache["20.index_keys"].shape == (2 * 128, 80)
    assert cache["0.window"].shape == (128, 528) and cache["0.window"].dtype == torch.uint8
    plain = ModelCache(c, CacheLayout(num_blocks=2, num_slots=1), device="meta", packed=False)
    assert plain["2.kv"].shape == (2 * 64, 512) and plain["2.kv"].dtype == torch.bfloat16
    assert "engram_history" in cache.extra


def test_rings_grow_with_max_draft_and_bad_layouts_fail():
    c = parse_config(V4_FLASH)
    cache = ModelCache(c, CacheLayout(num_blocks=1, num_slots=3, max_draft=5), device="meta")
    assert cache["0.window"].shape == (3 * 133, 592)
    assert cache["2.comp_kv"].shape == (3 * 13, 1024)  # 2 x 4 overlapped rows + 5
    assert cache["3.comp_kv"].shape == (3 * 133, 512)  # 128 + 5
    with pytest.raises(ValueError, match="block_size"):
        ModelCache(c, CacheLayout(num_blocks=1, num_slots=1, block_size=64), device="meta")
    with pytest.raises(ValueError, match="num_slots"):
        CacheLayout(num_blocks=1, num_slots=0)
    fp = cache_footprint(c)
    assert fp.num_blocks(10 * fp.bytes_per_block + 2 * fp.bytes_per_slot, 2) == 10
    assert cache["2.comp_score"].dtype == torch.float32
