"""Config parsing: the published V4-Flash / V4-Flash-0731 / V4.1-Flash files, the form
transformers writes, the derived layer schedule, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.model.config import ConfigError
from deepinfer.engine.model.config_parsing import load_config, parse_config

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

V41_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "moe_intermediate_size": 2304,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "max_position_embeddings": 1048576,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 256,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "text_config": V41_TEXT,
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32},
}


def test_v4_flash_schedule_and_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    c = load_config(tmp_path)
    assert (c.num_layers, c.hidden_size, c.rope_head_dim, c.nope_head_dim) == (43, 4096, 64, 448)
    kinds = [c.layer_kind(i) for i in range(43)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 43, 2))
    assert [i for i, k in enumerate(kinds) if k == "hca"] == list(range(3, 42, 2))
    assert c.mtp_compress_ratios == (0,)
    assert [c.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert c.quantization.weight_block_size == (128, 128) and c.quantization.expert_dtype == "fp4"
    assert c.numerics == "model"  # the roundings the model defines, by default
    assert c.rope_scaling.factor == 16 and c.compress_rope_theta == 160000
    assert all(c.kv_source_of(i) == i for i in range(2, 43))
    assert c.index_source_of(3) is None and c.index_source_of(4) == 4


def test_v4_flash_0731_trailing_ratios_are_draft_layers():
    c = parse_config({**V4_FLASH, "compress_ratios": V4_FLASH["compress_ratios"] + [0, 0]})
    assert c.num_layers == 43 and c.mtp_compress_ratios == (0, 0, 0)


def test_v41_nested_schedule_and_fields():
    c = parse_config(V41)
    assert c.is_v41 and c.num_layers == 40 and c.hidden_size == 5120
    assert c.mtp_compress_ratios == (0, 0, 0)
    assert [c.layer_kind(i) for i in (0, 1, 2, 19, 20, 39)] == [
        "swa",
        "swa",
        "c2",
        "c2",
        "c1",
        "c1",
    ]
    assert [c.kv_source_of(i) for i in (2, 7, 8, 13, 14, 19, 20, 39)] == [
        2,
        2,
        8,
        8,
        14,
        14,
        20,
        20,
    ]
    assert [c.index_source_of(i) for i in (21, 24, 27, 36, 39)] == [20, 24, 24, 36, 36]
    assert c.owns_compressor(20) and not c.owns_compressor(21)
    assert c.num_hash_layers == 0 and c.rms_norm_eps == 1e-20
    assert c.quantization.weight_block_size == (32, 32)
    assert c.engram_layer_ids == (1, 14) and c.engram_compressed_vocab_size == 99092
    assert c.dspark_target_layer_ids == (37, 38, 39) and c.dspark_n_routed_experts == 128
    assert c.image_token_id == 129264 and c.pad_token_id == 2
    assert c.vision_config["num_hidden_layers"] == 32


def test_transformers_normalised_form_matches_flat_form():
    transformers = pytest.importorskip("transformers")
    small = {**V4_FLASH, "num_hidden_layers": 5, "compress_ratios": [0, 4, 128, 4, 0]}
    small.pop("quantization_config")
    written = transformers.DeepseekV4Config(**small).to_dict()
    assert "layer_types" in written and "rope_parameters" in written
    ours, theirs = parse_config(small), parse_config(written)
    for field in (
        "compress_ratios",
        "num_hash_layers",
        "rope_head_dim",
        "rope_scaling",
        "compress_rope_theta",
        "rope_theta",
        "index_topk",
        "hc_mult",
    ):
        assert getattr(theirs, field) == getattr(ours, field), field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"compress_ratios": [0, -3] + [4, 128] * 20 + [4]}, "compress_ratios"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_inconsistent_v4_fields_name_the_field(change, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        parse_config({**V4_FLASH, **change})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kv_source_layer_ids": [3, 8, 14, 20]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36, 1]}, "index_source_layer_ids"),
        ({"candidate_source_layer_id": 21}, "candidate_source_layer_id"),
        ({"kv_source_layer_ids": [2, 8, 14, 19]}, "compress_ratios"),
        (
            {"index_source_layer_ids": [2, 8, 14, 24, 28, 32, 36], "candidate_source_layer_id": 24},
            "compress_ratios",
        ),
        ({"dspark_target_layer_ids": [37, 38, 40]}, "dspark_target_layer_ids"),
    ],
)
def test_inconsistent_v41_fields_name_the_field(change, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        parse_config({**V41, "text_config": {**V41_TEXT, **change}})


def test_v41_transformers_spellings():
    """transformers' DeepseekV41TextConfig writes ``engram_pad_id`` and ``layer_types`` of
    sliding / shared-compressed kinds, and disables the candidate filter with -1."""
    text = {k: v for k, v in V41_TEXT.items() if k != "engram_pad_token_id"}
    text.update(
        engram_pad_id=2,
        candidate_source_layer_id=-1,
        layer_types=[
            "shared_compressed_attention" if i in (2, 8, 14, 20) else "sliding_attention"
            for i in range(40)
        ],
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    )
    text.pop("rope_scaling")
    c = parse_config({**V41, "text_config": text})
    assert c.engram_pad_token_id == 2 and c.candidate_source_layer_id is None
    assert c.compress_ratios == parse_config(V41).compress_ratios
    assert c.rope_scaling == parse_config(V41).rope_scaling
