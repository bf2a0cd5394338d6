"""Name mapping: official, transformers module names, and save_pretrained's spelling."""

from __future__ import annotations

import pytest

from deepinfer.engine.checkpoint.names import ExpertSlice, official_name, split_fused_experts

CASES = [
    # (any spelling, official)
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.layers.3.input_layernorm.weight", "layers.3.attn_norm.weight"),
    ("model.layers.3.post_attention_layernorm.weight", "layers.3.ffn_norm.weight"),
    ("model.layers.3.attn_hc.fn", "layers.3.hc_attn_fn"),
    ("model.layers.3.ffn_hc.scale", "layers.3.hc_ffn_scale"),
    ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
    ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
    ("model.layers.3.self_attn.q_a_proj.weight_scale_inv", "layers.3.attn.wq_a.scale"),
    ("model.layers.3.self_attn.q_a_norm.weight", "layers.3.attn.q_norm.weight"),
    ("model.layers.3.self_attn.q_b_proj.weight", "layers.3.attn.wq_b.weight"),
    ("model.layers.3.self_attn.kv_proj.weight", "layers.3.attn.wkv.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),  # save_pretrained
    ("model.layers.3.self_attn.o_a_proj.weight", "layers.3.attn.wo_a.weight"),
    ("model.layers.3.self_attn.o_b_proj.weight", "layers.3.attn.wo_b.weight"),
    ("model.layers.3.self_attn.compressor.position_bias", "layers.3.attn.compressor.ape"),
    ("model.layers.3.self_attn.compressor.kv_proj.weight", "layers.3.attn.compressor.wkv.weight"),
    (
        "model.layers.3.self_attn.compressor.gate_proj.weight",
        "layers.3.attn.compressor.wgate.weight",
    ),
    ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
    (
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        "layers.3.attn.indexer.compressor.norm.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.position_bias",
        "layers.3.attn.indexer.compressor.ape",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.attn.indexer.wq_b.weight",
    ),
    (
        "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.attn.indexer.weights_proj.weight",
    ),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
    ("model.layers.0.mlp.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", "layers.3.ffn.shared_experts.w1.weight"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "layers.3.ffn.shared_experts.w3.weight"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", "layers.3.ffn.shared_experts.w2.weight"),
    ("model.layers.3.ffn.experts.5.w2.weight", "layers.3.ffn.experts.5.w2.weight"),
    ("model.layers.3.mlp.experts.gate_up_proj", "layers.3.ffn.experts.gate_up_proj"),
    ("vision.blocks.0.mlp.w1.weight", "vision.blocks.0.mlp.w1.weight"),
    ("model.vision.blocks.0.attn.wqkv.bias", "vision.blocks.0.attn.wqkv.bias"),
]


@pytest.mark.parametrize("name, official", CASES)
def test_official_name(name, official):
    assert official_name(name) == official


@pytest.mark.parametrize("official", sorted({o for _, o in CASES}))
def test_official_names_are_fixed_points(official):
    assert official_name(official) == official


def test_fused_experts_split_gate_rows_first():
    parts = split_fused_experts("layers.1.ffn.experts.gate_up_proj", (3, 8, 5))
    assert [p[0] for p in parts[:2]] == [
        "layers.1.ffn.experts.0.w1.weight",
        "layers.1.ffn.experts.0.w3.weight",
    ]
    assert parts[0][1:] == (ExpertSlice(0, 0, 4), (4, 5))
    assert parts[5][1:] == (ExpertSlice(2, 4, 8), (4, 5))
    down = split_fused_experts("layers.1.ffn.experts.down_proj", (3, 5, 4))
    assert [n for n, _, _ in down] == [f"layers.1.ffn.experts.{e}.w2.weight" for e in range(3)]
    assert down[1][1:] == (ExpertSlice(1, 0, 5), (5, 4))
    with pytest.raises(ValueError, match="fused"):
        split_fused_experts("layers.1.ffn.experts.down_proj", (5, 4))
