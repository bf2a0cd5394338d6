"""Whole-slot cache operations: resetting several slots at once is resetting each alone."""

from __future__ import annotations

import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.runner.cache_ops import reset_slot, reset_slots
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config


def _random_cache(raw: dict) -> ModelCache:
    layout = CacheLayout(num_blocks=3, num_slots=7, block_size=128, max_draft=2)
    cache = ModelCache(parse_config(raw), layout, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for t in [*cache.tensors.values(), *cache.extra.values()]:
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 100, t.shape, generator=g))
    return cache


def test_reset_slots_equals_one_reset_per_slot():
    for raw in (tiny_v4_config(), tiny_v41_config(vision=False)):
        together, alone = _random_cache(raw), _random_cache(raw)
        slots = [5, 1, 2, 3]  # two runs, out of order
        reset_slots(together, slots)
        for slot in slots:
            reset_slot(alone, slot)
        for key, t in together.tensors.items():
            assert torch.equal(t, alone.tensors[key]), key
        for key, t in together.extra.items():
            assert torch.equal(t, alone.extra[key]), key
        ring = together.tensors["0.window"].view(7, -1)
        assert not ring[[1, 2, 3, 5]].any() and all(ring[s].any() for s in (0, 4, 6))
