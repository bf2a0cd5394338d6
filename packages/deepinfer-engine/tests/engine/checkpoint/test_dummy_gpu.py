"""Dummy weights of the real V4-Flash shapes on the GPU (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.engine.checkpoint import fill_dummy, official_inventory
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing import module_with_tensors, tiny_v4_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_v4_flash_layer_fills_fast_on_the_gpu():
    raw = tiny_v4_config(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=2,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        compress_ratios=[4, 128],
        index_n_heads=64,
        index_head_dim=128,
        n_routed_experts=256,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        num_hash_layers=1,
        hc_mult=4,
        expert_dtype="fp4",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )
    inventory = official_inventory(parse_config(raw))
    module = module_with_tensors({n: (s.shape, s.dtype) for n, s in inventory.items()}, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    fill_dummy(module, seed=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    state = module.state_dict()
    tid2eid = state["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (129280, 6) and int(tid2eid.min()) >= 0 and int(tid2eid.max()) < 256
    assert (tid2eid.sort(-1).values.diff(dim=-1) > 0).all()
    assert torch.isfinite(state["layers.1.attn.wq_b.weight"].float()).all()
    print(f"dummy fill of {len(state)} tensors: {elapsed:.2f} s")
    assert elapsed < 30
