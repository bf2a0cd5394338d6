"""Tiny ``config.json`` dicts of both architectures, for tests (real field names and layout).

The V4.1 Engram geometry is derived as the model derives it: table sizes from the hashing
primes, the compressed vocabulary from the test tokenizer ``make_random_checkpoint`` writes.

Sizes respect the quantised formats: every width an FP8 activation group (128 in V4, 32 in
V4.1) or an FP4 block (32) divides; the V4 no-RoPE head part is a multiple of the KV FP8 block
(64), and the RoPE part fits in the indexer head. ``overrides`` replace top-level keys (V4) or ``text_config`` keys (V4.1).
"""

from __future__ import annotations

import copy
from typing import Any

from deepinfer.engine.testing.vision_configs import tiny_vision_config


def tiny_v4_config(*, hca_ratio: int = 128, **overrides: Any) -> dict[str, Any]:
    """4 backbone layers (SWA, CSA, HCA, CSA) + 1 MTP block; hash routing in layer 0.
    ``hca_ratio``: the HCA layer's compression ratio (128 as in the released models)."""
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 512,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 96,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 64,
        "sliding_window": 8,
        "compress_ratios": [0, 4, hca_ratio, 4, 0],
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
        "index_n_heads": 2,
        "index_head_dim": 64,
        "index_topk": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(copy.deepcopy(overrides))
    return config


def tiny_v41_config(*, vision: bool = True, **text_overrides: Any) -> dict[str, Any]:
    """8 backbone layers (SWA, SWA, ratio 2 x3, ratio 1 x3) + 3 DSpark stages, Engram at layers
    1 and 4, and (optionally) a one-block vision tower."""
    text: dict[str, Any] = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 5],
        "index_source_layer_ids": [2, 4, 5, 7],
        "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "max_position_embeddings": 1048576,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 4],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 97,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 16,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    text.update(copy.deepcopy(text_overrides))
    _fill_engram_geometry(text)
    config: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 15,
        "text_config": text,
    }
    if vision:
        config["vision_config"] = tiny_vision_config()
    return config


def _fill_engram_geometry(text: dict[str, Any]) -> None:
    """Table sizes and compressed vocabulary as the model's Engram hashing derives them."""
    if not text.get("engram_layer_ids"):
        return
    from deepinfer.engine.model.engram_hashing import compressed_token_map, table_primes

    if "engram_compressed_vocab_size" not in text:
        # The test tokenizer make_random_checkpoint writes, as the model will compress it.
        from deepinfer.engine.testing.random_checkpoint import testing_tokenizer_for

        backend = testing_tokenizer_for(text["vocab_size"]).backend
        text["engram_compressed_vocab_size"] = int(compressed_token_map(backend).max()) + 1
    if "engram_num_embeddings" in text:
        return

    primes = table_primes(
        len(text["engram_layer_ids"]),
        text["engram_max_ngram_size"],
        text["engram_n_heads"],
        text["engram_vocab_size"],
    )
    text["engram_num_embeddings"] = [int(sum(row)) for row in primes]
