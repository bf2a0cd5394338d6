"""DSpark draft stages: checkpoint names and storage formats, the draft config, the window index
lists and the seed rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.layers import Embedding, LinearFactory
from deepinfer.engine.model.mtp import DSparkDraft, draft_config
from deepinfer.engine.model.mtp_window import draft_metadata, seed_rows
from deepinfer.engine.model.rope import RopeTables

VOCAB, DIM, HEAD_DIM, ROPE_DIM, WINDOW, BLOCK, RANK = 64, 32, 16, 8, 4, 3, 8


def tiny_config(v41=False, **extra):
    text = {
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "compress_ratios": [0] * 5,
        "num_hash_layers": 0,
        "sliding_window": WINDOW,
        "hc_mult": 2,
        "dspark_block_size": BLOCK,
        "dspark_noise_token_id": VOCAB - 1,
        "dspark_target_layer_ids": [0, 1],
        "dspark_markov_rank": RANK,
        **extra,
    }
    if v41:
        raw = {"architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    else:
        raw = {"architectures": ["DeepseekV4ForCausalLM"], **text}
    return parse_config(raw)


def randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def build(v41=False, num_slots=3):
    cfg = tiny_config(v41)
    draft = DSparkDraft(cfg, LinearFactory(cfg, torch.float32))
    randomise(draft)
    cache = ModelCache(
        cfg, CacheLayout(num_blocks=1, num_slots=num_slots, max_draft=BLOCK), dtype=torch.float32
    )
    draft.allocate(cache)
    embed = Embedding(VOCAB, DIM, dtype=torch.float32)
    randomise(embed, 1)
    head = torch.randn(VOCAB, DIM)
    return cfg, draft, cache, embed, head, RopeTables(cfg)


def _shapes(module, prefix):
    return {prefix + k: tuple(v.shape) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("v41", [False, True])
def test_stage_extras_carry_the_checkpoint_names(v41):
    cfg = tiny_config(v41, dspark_n_routed_experts=3, dspark_num_experts_per_tok=1)
    names = _shapes(DSparkDraft(cfg, LinearFactory(cfg, torch.bfloat16)), "mtp.")
    markov = ("embed", "head") if v41 else ("markov_w1", "markov_w2")
    extras = {
        "mtp.0.main_proj.weight": (DIM, 2 * DIM),
        "mtp.0.main_norm.weight": (DIM,),
        "mtp.2.norm.weight": (DIM,),
        f"mtp.2.markov_head.{markov[0]}.weight": (VOCAB, RANK),
        f"mtp.2.markov_head.{markov[1]}.weight": (VOCAB, RANK),
        "mtp.2.confidence_head.proj.weight": (1, DIM + RANK),
    }
    if not v41:
        extras.update(
            {
                "mtp.2.hc_head_fn": (2, 2 * DIM),
                "mtp.2.hc_head_base": (2,),
                "mtp.2.hc_head_scale": (1,),
            }
        )
    assert {k: names.get(k) for k in extras} == extras
    # the middle stage is a plain block: same names as stage 1 of the block list
    assert {k.split(".", 2)[2] for k in names if k.startswith("mtp.1.")} >= {
        "attn.wq_a.weight",
        "attn.wkv.weight",
        "attn.attn_sink",
        "hc_attn_fn",
        "ffn.gate.bias",
        "ffn.shared_experts.w1.weight",
        "attn_norm.weight",
    }
    assert not any(k.startswith("mtp.1.") and "main_" in k for k in names)
    assert names["mtp.1.ffn.gate.weight"] == (3, DIM)  # the drafter's own expert count
    assert "mtp.1.ffn.experts.2.w1.weight" in names and "mtp.1.ffn.experts.3.w1.weight" not in names


def test_draft_config_appends_sliding_window_draft_layers():
    cfg = tiny_config()
    dc = draft_config(cfg)
    assert dc.num_layers == 5 and dc.compress_ratios == (0,) * 5
    assert [dc.layer_kind(i) for i in range(2, 5)] == ["swa"] * 3


def test_draft_metadata_hand_checked():
    # B=2, K=2, W=3, ring 5, 3 slots (base row 15); request 0: p=1 in slot 2, request 1: p=6
    # in slot 0. Main window rows: slot * 5 + pos % 5 (-1 before position 0); block rows 15...
    md = draft_metadata(torch.tensor([1, 6]), torch.tensor([2, 0]), 2, 3, 5, 3)
    want = [[-1, 10, 11, 15, 16]] * 2 + [[4, 0, 1, 17, 18]] * 2
    assert md.window_indices.tolist() == want
    assert md.window_base == 15
    assert md.window_write_src.tolist() == [0, 1, 2, 3]
    assert md.window_write_dst.tolist() == [12, 13, 2, 3]  # positions 2, 3 / 7, 8
    with pytest.raises(ValueError, match="ring_size = 4"):
        draft_metadata(torch.tensor([1]), torch.tensor([0]), 2, 3, 4, 1)


def test_seed_rows_copy_the_latest_position_of_each_ring_row():
    # ring 4, slot 0 positions 0..5 (rows 0,1,2,3,0,1), slot 1 position 9 (row 4 + 1)
    src, dst = seed_rows(torch.tensor([0, 1, 2, 3, 4, 5, 9]), torch.tensor([0] * 6 + [1]), 4, 2)
    assert dst.tolist() == [0, 1, 2, 3, 0, 1, 5]
    assert src.tolist() == [4, 5, 2, 3, 4, 5, 6]


def test_quantised_checkpoint_stores_main_proj_fp8_and_the_heads_bf16():
    raw_quant = {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"}
    cfg = tiny_config(True, quantization_config=raw_quant)
    state = DSparkDraft(cfg, LinearFactory(cfg, torch.bfloat16)).state_dict()
    got = {
        k: (tuple(state[k].shape), state[k].dtype)
        for k in (
            "0.main_proj.weight",
            "0.main_proj.scale",
            "0.main_norm.weight",
            "2.markov_head.embed.weight",
            "2.markov_head.head.weight",
            "2.confidence_head.proj.weight",
        )
    }
    assert got == {
        "0.main_proj.weight": ((DIM, 2 * DIM), torch.float8_e4m3fn),
        "0.main_proj.scale": ((1, 2), torch.float8_e8m0fnu),
        "0.main_norm.weight": ((DIM,), torch.bfloat16),
        "2.markov_head.embed.weight": ((VOCAB, RANK), torch.bfloat16),
        "2.markov_head.head.weight": ((VOCAB, RANK), torch.bfloat16),
        "2.confidence_head.proj.weight": ((1, DIM + RANK), torch.bfloat16),
    }
