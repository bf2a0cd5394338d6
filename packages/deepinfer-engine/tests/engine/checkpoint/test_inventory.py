"""The expected tensor inventory of each architecture (spec deepseek-v4.md 4.1, 2.9, 2.10, 7)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.checkpoint import official_inventory
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config, with_quantization

FP8, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def v4_flash_config() -> dict:
    """V4-Flash's published config.json (spec 1.1), sizes and quantisation included."""
    return tiny_v4_config(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=256,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        num_hash_layers=3,
        hc_mult=4,
        expert_dtype="fp4",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    )


def test_v4_flash_inventory_matches_the_published_tensor_count_and_shapes():
    inv = official_inventory(parse_config(v4_flash_config()))
    # 2 SWA x 1565 + 21 CSA x 1576 + 20 HCA x 1569 + mtp.0 1575 + 6 globals (spec 4.1)
    assert len(inv) == 69187
    assert sum(n.startswith("mtp.0.") for n in inv) == 1575
    expect = {
        "embed.weight": ([129280, 4096], torch.bfloat16),
        "hc_head_fn": ([4, 16384], torch.float32),
        "layers.0.ffn.gate.tid2eid": ([129280, 6], torch.int64),
        "layers.3.ffn.gate.bias": ([256], torch.float32),
        "layers.2.attn.wq_b.weight": ([32768, 1024], FP8),
        "layers.2.attn.wq_b.scale": ([256, 8], E8M0),
        "layers.2.attn.wo_a.scale": ([64, 32], E8M0),
        "layers.2.attn.compressor.ape": ([4, 1024], torch.float32),
        "layers.3.attn.compressor.ape": ([128, 512], torch.float32),
        "layers.2.attn.indexer.compressor.wkv.weight": ([256, 4096], torch.bfloat16),
        "layers.2.attn.indexer.wq_b.scale": ([64, 8], E8M0),
        "layers.5.ffn.experts.7.w1.weight": ([2048, 2048], torch.int8),
        "layers.5.ffn.experts.7.w1.scale": ([2048, 128], E8M0),
        "layers.5.ffn.experts.7.w2.weight": ([4096, 1024], torch.int8),
        "layers.5.ffn.experts.7.w2.scale": ([4096, 64], E8M0),
        "layers.5.ffn.shared_experts.w2.scale": ([32, 16], E8M0),
        "mtp.0.e_proj.weight": ([4096, 4096], FP8),
        "mtp.0.hc_head_scale": ([1], torch.float32),
    }
    for name, (shape, dtype) in expect.items():
        assert (list(inv[name].shape), inv[name].dtype) == (shape, dtype), name
    assert "layers.3.attn.indexer.wq_b.weight" not in inv  # HCA has no indexer
    assert "layers.0.ffn.gate.bias" not in inv and "layers.3.ffn.gate.tid2eid" not in inv


def test_unquantised_inventory_has_float_weights_and_no_scales():
    inv = official_inventory(parse_config(with_quantization(tiny_v4_config(), False)))
    assert not any(n.endswith(".scale") for n in inv)
    assert inv["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert inv["layers.1.ffn.experts.0.w1.weight"].shape == (128, 128)


def test_v41_inventory_follows_the_shared_kv_schedule():
    raw = with_quantization(tiny_v41_config(), True)
    config = parse_config(raw)
    inv = official_inventory(config)
    # kv sources (2, 5) own the compressor and index keys; ratio 2 also has a gate
    assert "layers.2.attn.compressor.wgate.weight" in inv
    assert "layers.5.attn.compressor.wkv.weight" in inv
    assert "layers.5.attn.compressor.wgate.weight" not in inv  # ratio 1
    assert inv["layers.2.attn.indexer.wk.weight"].shape == (32, 64)
    for layer in (3, 4, 6, 7):
        assert f"layers.{layer}.attn.compressor.wkv.weight" not in inv
    # index sources (2, 4, 5, 7) own the query side
    for layer in (2, 4, 5, 7):
        assert inv[f"layers.{layer}.attn.indexer.wq_b.weight"].dtype == FP8
    assert "layers.3.attn.indexer.wq_b.weight" not in inv
    # no hash layers, bias_vl everywhere, no hc_head in V4.1
    assert "layers.0.ffn.gate.bias_vl" in inv and "hc_head_fn" not in inv
    # 32x32 blocks
    assert inv["layers.0.attn.wq_b.scale"].shape == (256 // 32, 64 // 32)


def test_v41_engram_dspark_and_vision_entries():
    raw = with_quantization(tiny_v41_config(), True)
    config = parse_config(raw)
    inv = official_inventory(config)
    rows = raw["text_config"]["engram_num_embeddings"]
    assert inv["layers.1.engram.embed.weight"].shape == (rows[0], 32)
    assert inv["layers.4.engram.embed.scale"].shape == (rows[1], 1)
    assert inv["layers.1.engram.wkv.weight"].shape == (64 * 3, 2 * 2 * 32)
    assert inv["mtp.0.main_proj.weight"].shape == (64, 64 * 3)
    assert inv["mtp.2.markov_head.embed.weight"].shape == (512, 32)
    assert inv["mtp.2.confidence_head.proj.weight"].shape == (1, 64 + 32)
    assert "mtp.1.norm.weight" not in inv and "mtp.2.norm.weight" in inv
    vision = {n: s for n, s in inv.items() if s.skip}
    assert "vision.blocks.0.attn.wqkv.weight" in vision
    assert vision["aligner.w1.weight"].shape == (64, 32 * 9)
    assert all(n.startswith(("vision.", "aligner.", "image_")) for n in vision)
    assert not any(s.skip for n, s in inv.items() if n not in vision)
    unquantised = official_inventory(parse_config(with_quantization(tiny_v41_config(), False)))
    assert unquantised["layers.1.engram.embed.weight"].dtype == torch.bfloat16
    assert "layers.1.engram.embed.scale" not in unquantised


DSPARK_V4 = dict(
    compress_ratios=[0, 4, 128, 4, 0, 0, 0],
    dspark_block_size=3,
    dspark_target_layer_ids=[1, 2, 3],
    dspark_markov_rank=32,
    dspark_noise_token_id=16,
)


@pytest.mark.parametrize(
    "raw",
    [tiny_v4_config(), tiny_v4_config(**DSPARK_V4), tiny_v41_config()],
    ids=["v4-mtp", "v4-dspark", "v41"],
)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantised"])
def test_inventory_matches_the_model_modules(raw, quantized):
    """The model helper's modules (official parameter names) hold exactly the inventory."""
    from deepinfer.engine.model.layers import LinearFactory
    from deepinfer.engine.model.model import expected_tensors
    from deepinfer.engine.model.mtp import build_draft_stages

    config = parse_config(with_quantization(raw, quantized))
    module = dict(expected_tensors(config))
    stages = build_draft_stages(config, LinearFactory(config, torch.bfloat16, "meta"))
    for name, t in stages.state_dict().items():
        module[f"mtp.{name}"] = (tuple(t.shape), t.dtype)
    inv = {n: s for n, s in official_inventory(config).items() if not s.unused}
    assert sorted(module) == sorted(inv)
    for name, (shape, dtype) in module.items():
        assert inv[name].shape == shape, name
        assert inv[name].accepts(dtype), name
