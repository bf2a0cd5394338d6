"""Checkpoints written by ``transformers`` load to the same values as official-named ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.engine.checkpoint import (
    load_into,
    official_inventory,
    read_and_validate,
    read_checkpoint_index,
    read_tensors,
)
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.testing import module_with_tensors, write_checkpoint

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(
    vocab_size=300,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    o_lora_rank=8,
    o_groups=2,
    index_n_heads=2,
    index_head_dim=16,
    hc_mult=2,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe"],
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """(save_pretrained dir, raw module-state-dict dir, the module state dict)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**HF_CONFIG)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "tid2eid" not in name:
                p.normal_(0, 0.1)
    saved = tmp_path_factory.mktemp("saved")
    model.save_pretrained(saved)
    raw = tmp_path_factory.mktemp("raw")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(raw / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(saved / "config.json", raw / "config.json")
    return saved, raw, state


def test_both_transformers_spellings_validate_and_agree(hf_dirs):
    saved, raw, hf_state = hf_dirs
    config = load_config(saved)
    stored_saved, _ = read_and_validate(saved, config)
    stored_raw, _ = read_and_validate(raw, config)
    assert sorted(stored_saved) == sorted(stored_raw) == sorted(official_inventory(config))
    a, b = read_tensors(saved), read_tensors(raw)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the fused experts are split gate rows first, then up rows
    gate_up = hf_state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(b["layers.1.ffn.experts.2.w1.weight"], gate_up[2, :16])
    assert torch.equal(b["layers.1.ffn.experts.2.w3.weight"], gate_up[2, 16:])
    down = hf_state["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(b["layers.1.ffn.experts.3.w2.weight"], down[3])
    kv_norm = hf_state["model.layers.2.self_attn.kv_norm.weight"]
    assert torch.equal(a["layers.2.attn.kv_norm.weight"], kv_norm)
    compressor_norm = hf_state["model.layers.2.self_attn.compressor.kv_norm.weight"]
    assert torch.equal(a["layers.2.attn.compressor.norm.weight"], compressor_norm)


def test_transformers_checkpoint_loads_like_the_official_one(hf_dirs, tmp_path):
    saved, raw, _ = hf_dirs
    config = load_config(saved)
    official = tmp_path / "official"
    raw_config = json.loads((saved / "config.json").read_text())
    write_checkpoint(official, raw_config, read_tensors(saved), float_dtype=torch.float32)
    assert all("model." not in n for n in read_checkpoint_index(official))
    inventory = official_inventory(config)
    specs = {n: (s.shape, torch.float32 if s.is_float else s.dtype) for n, s in inventory.items()}
    states = []
    for directory in (saved, raw, official):
        module = module_with_tensors(specs)
        load_into(module, directory, progress=False)
        states.append(module.state_dict())
    for name in specs:
        assert torch.equal(states[0][name], states[1][name]), name
        assert torch.equal(states[0][name], states[2][name]), name
