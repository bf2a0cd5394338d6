"""V4's MTP block (mtp.0): names, the input combination, chunked == whole in the target batch."""

from __future__ import annotations

import torch

from deepinfer.engine.model.block import Block
from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import Embedding, LinearFactory
from deepinfer.engine.model.metadata import ForwardBatch, build_metadata
from deepinfer.engine.model.mtp import MTPBlock, build_draft_stages
from deepinfer.engine.model.rope import RopeTables

VOCAB, DIM, NC = 64, 32, 2


def tiny_v4():
    return parse_config(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": DIM,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "qk_rope_head_dim": 8,
            "q_lora_rank": 16,
            "o_groups": 2,
            "o_lora_rank": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "compress_ratios": [0, 0, 0],
            "num_hash_layers": 0,
            "sliding_window": 4,
            "hc_mult": NC,
        }
    )


def randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


def setup():
    cfg = tiny_v4()
    stages = build_draft_stages(cfg, LinearFactory(cfg, torch.float32))
    block = stages[0]
    randomise(block)
    embed = Embedding(VOCAB, DIM, dtype=torch.float32)
    randomise(embed, 1)
    return cfg, block, embed


def new_cache(cfg, block):
    cache = ModelCache(cfg, CacheLayout(num_blocks=1, num_slots=2), dtype=torch.float32)
    block.allocate(cache)
    return cache


def context(cfg, cache, ids, start, slot=0):
    n = len(ids)
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.arange(start, start + n),
        cu_seqlens_q=torch.tensor([0, n]),
        seq_lens=torch.tensor([start + n]),
        block_tables=torch.tensor([[0]]),
        state_slots=torch.tensor([slot]),
    )
    md = build_metadata(batch, cfg, cache.layout, cache.ring_size)
    rope = RopeTables(cfg)
    angles = {c: RopeTables.angles(rope.table(c), batch.positions) for c in (False, True)}
    return StepContext(md, cache, ids, batch.positions, rope, angles)


def test_mtp_block_names_and_shapes():
    cfg, block, _ = setup()
    assert isinstance(block, MTPBlock) and block.layer_id == cfg.num_layers
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    want = {
        "e_proj.weight": (DIM, DIM),
        "h_proj.weight": (DIM, DIM),
        "enorm.weight": (DIM,),
        "hnorm.weight": (DIM,),
        "norm.weight": (DIM,),
        "hc_head_fn": (NC, NC * DIM),
        "hc_head_base": (NC,),
        "hc_head_scale": (1,),
        "ffn.gate.bias": (4,),
    }
    assert {k: shapes.get(k) for k in want} == want


def rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def test_input_is_projected_embedding_plus_projected_streams():
    cfg, block, embed = setup()
    streams, ids, nxt = (
        torch.randn(6, NC, DIM),
        torch.randint(0, VOCAB, (6,)),
        torch.randint(0, VOCAB, (6,)),
    )
    got = block(streams, nxt, embed, context(cfg, new_cache(cfg, block), ids, 0))
    eps = cfg.rms_norm_eps
    e = rms64(embed.weight[nxt], block.enorm.weight, eps) @ block.e_proj.weight.double().t()
    h = rms64(streams, block.hnorm.weight, eps) @ block.h_proj.weight.double().t()
    x = (e[:, None, :] + h).float()
    want = Block.forward(block, x, context(cfg, new_cache(cfg, block), ids, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    logits = block.logits(got, torch.randn(VOCAB, DIM))
    assert logits.shape == (6, VOCAB) and logits.dtype == torch.float32


def test_chunked_equals_whole_through_the_mtp_window_ring():
    cfg, block, embed = setup()
    streams, ids, nxt = (
        torch.randn(9, NC, DIM),
        torch.randint(0, VOCAB, (9,)),
        torch.randint(0, VOCAB, (9,)),
    )
    whole = block(streams, nxt, embed, context(cfg, new_cache(cfg, block), ids, 0))
    cache, parts, start = new_cache(cfg, block), [], 0
    for n in (3, 1, 5):
        rows = slice(start, start + n)
        parts.append(
            block(streams[rows], nxt[rows], embed, context(cfg, cache, ids[rows], start, 1))
        )
        start += n
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
