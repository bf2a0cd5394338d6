"""The draft stages and Engram at the released sizes (built on the meta device: no memory).

Config values are the released ones (spec 1.1 for V4-Flash-0731, 1.3 for V4.1-Flash); shapes
are the checkpoint's (spec 2.10, 4.1, 7.3, 7.5).
"""

from __future__ import annotations

import torch

from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.engram import Engram, EngramConfig
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.engine.model.mtp import DSparkDraft

FP8, E8M0, BF16 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16
COMMON = {
    "vocab_size": 129280,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "sliding_window": 128,
    "hc_mult": 4,
    "index_head_dim": 128,
    "index_topk": 512,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 256,
}


def v4_0731():
    ratios = [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    return parse_config(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            **COMMON,
            "hidden_size": 4096,
            "num_hidden_layers": 43,
            "q_lora_rank": 1024,
            "n_routed_experts": 256,
            "moe_intermediate_size": 2048,
            "num_hash_layers": 3,
            "compress_ratios": ratios,
            "index_n_heads": 64,
            "dspark_target_layer_ids": [40, 41, 42],
            "quantization_config": quant,
        }
    )


def v41():
    text = {
        **COMMON,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "q_lora_rank": 1280,
        "n_routed_experts": 384,
        "moe_intermediate_size": 2304,
        "rms_norm_eps": 1e-20,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "index_n_heads": 32,
        "num_nextn_predict_layers": 3,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
        "dspark_target_layer_ids": [37, 38, 39],
        "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3,
    }
    quant = {
        "quant_method": "fp8",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    return parse_config(
        {
            "architectures": ["DeepseekV41ForCausalLM"],
            "text_config": text,
            "quantization_config": quant,
        }
    )


def inventory(module, prefix):
    return {prefix + k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def test_v4_0731_dspark_stages_at_released_size():
    cfg = v4_0731()
    inv = inventory(DSparkDraft(cfg, LinearFactory(cfg, BF16, "meta")), "mtp.")
    assert [k for k in inv if k.endswith("attn_norm.weight")] == [
        f"mtp.{i}.attn_norm.weight" for i in range(3)
    ]
    want = {
        "mtp.0.main_proj.weight": ((4096, 12288), FP8),
        "mtp.0.main_proj.scale": ((32, 96), E8M0),
        "mtp.0.main_norm.weight": ((4096,), BF16),
        "mtp.1.attn.wq_b.weight": ((32768, 1024), FP8),
        "mtp.1.ffn.gate.bias": ((256,), torch.float32),
        "mtp.1.ffn.experts.255.w1.weight": ((2048, 2048), torch.int8),
        "mtp.1.ffn.experts.255.w1.scale": ((2048, 128), E8M0),
        "mtp.2.norm.weight": ((4096,), BF16),
        "mtp.2.hc_head_fn": ((4, 16384), torch.float32),
        "mtp.2.markov_head.markov_w1.weight": ((129280, 256), BF16),
        "mtp.2.markov_head.markov_w2.weight": ((129280, 256), BF16),
        "mtp.2.confidence_head.proj.weight": ((1, 4352), BF16),
    }
    assert {k: inv.get(k) for k in want} == want
    assert "mtp.1.ffn.gate.tid2eid" not in inv and "mtp.1.main_proj.weight" not in inv


def test_v41_dspark_stages_at_released_size():
    cfg = v41()
    inv = inventory(DSparkDraft(cfg, LinearFactory(cfg, BF16, "meta")), "mtp.")
    want = {
        "mtp.0.main_proj.weight": ((5120, 15360), FP8),
        "mtp.0.main_proj.scale": ((160, 480), E8M0),
        "mtp.0.attn.wq_a.weight": ((1280, 5120), FP8),
        "mtp.2.ffn.gate.weight": ((128, 5120), BF16),
        "mtp.2.ffn.experts.127.w3.weight": ((2304, 2560), torch.int8),
        "mtp.2.markov_head.embed.weight": ((129280, 256), BF16),
        "mtp.2.markov_head.head.weight": ((129280, 256), BF16),
        "mtp.2.confidence_head.proj.weight": ((1, 5376), BF16),
    }
    assert {k: inv.get(k) for k in want} == want
    assert "mtp.2.ffn.experts.128.w1.weight" not in inv
    assert not any("hc_head" in k for k in inv)  # V4.1 collapses with the deferred pre


def test_v41_engram_at_released_size():
    cfg = v41()
    engram = Engram(EngramConfig.from_model_config(cfg, 14), LinearFactory(cfg, BF16, "meta"))
    assert inventory(engram, "layers.14.engram.") == {
        "layers.14.engram.embed.weight": ((384016682, 256), FP8),
        "layers.14.engram.embed.scale": ((384016682, 8), E8M0),
        "layers.14.engram.wkv.weight": ((25600, 6144), FP8),
        "layers.14.engram.wkv.scale": ((800, 192), E8M0),
        "layers.14.engram.q_weight": ((4, 5120), BF16),
        "layers.14.engram.k_weight": ((4, 5120), BF16),
    }
