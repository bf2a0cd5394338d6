"""Inventory entries of decoder layers: the backbone's blocks (attention with its V4 or V4.1
compression, MoE, mHC, Engram) and the MTP / DSpark draft stages built from the same blocks
(spec deepseek-v4.md sections 4.1, 2.9, 2.10, 7.2, 7.3)."""

from __future__ import annotations

import torch

from deepinfer.engine.checkpoint.inventory_builder import (
    E8M0,
    ENGRAM_SCALE_BLOCK,
    F32,
    FP8,
    InventoryBuilder,
)

# Why a float checkpoint's Engram scale is skipped (the reason a load report lists).
FLOAT_ENGRAM_SCALE = "Engram table scale of a float checkpoint (unused, as in transformers)"


def add_hc_head(inv: InventoryBuilder, prefix: str) -> None:
    c = inv.config
    inv.add(f"{prefix}hc_head_fn", (c.hc_mult, c.hc_mult * c.hidden_size), F32)
    inv.add(f"{prefix}hc_head_base", (c.hc_mult,), F32)
    inv.add(f"{prefix}hc_head_scale", (1,), F32)


def add_block(
    inv: InventoryBuilder,
    prefix: str,
    layer_id: int,
    *,
    ratio: int | None = None,
    n_experts: int | None = None,
    optional_bias_vl: bool = False,
) -> None:
    """One decoder block: norms, both mHC sites, attention and MoE.

    ``layer_id`` indexes the backbone schedule; MTP stages pass their own ``ratio`` (0) and
    expert count, and are never hash-routed.
    """
    c = inv.config
    is_backbone = ratio is None
    mix = (2 + c.hc_mult) * c.hc_mult
    inv.add(f"{prefix}.attn_norm.weight", (c.hidden_size,))
    inv.add(f"{prefix}.ffn_norm.weight", (c.hidden_size,))
    for site in ("attn", "ffn"):
        inv.add(f"{prefix}.hc_{site}_fn", (mix, c.hc_mult * c.hidden_size), F32)
        inv.add(f"{prefix}.hc_{site}_base", (mix,), F32)
        inv.add(f"{prefix}.hc_{site}_scale", (3,), F32)
    add_attention(inv, f"{prefix}.attn", layer_id if is_backbone else None, ratio or 0)
    hash_routed = is_backbone and c.is_hash_layer(layer_id)
    add_moe(
        inv,
        f"{prefix}.ffn",
        hash_routed=hash_routed,
        n_experts=n_experts or c.n_routed_experts,
        optional_bias_vl=optional_bias_vl,
    )


def add_attention(inv: InventoryBuilder, prefix: str, layer_id: int | None, ratio: int) -> None:
    c = inv.config
    heads_dim = c.num_heads * c.head_dim
    inv.add(f"{prefix}.attn_sink", (c.num_heads,), F32)
    inv.linear(f"{prefix}.wq_a", c.q_lora_rank, c.hidden_size)
    inv.add(f"{prefix}.q_norm.weight", (c.q_lora_rank,))
    inv.linear(f"{prefix}.wq_b", heads_dim, c.q_lora_rank)
    inv.linear(f"{prefix}.wkv", c.head_dim, c.hidden_size)
    inv.add(f"{prefix}.kv_norm.weight", (c.head_dim,))
    inv.linear(f"{prefix}.wo_a", c.o_groups * c.o_lora_rank, heads_dim // c.o_groups)
    inv.linear(f"{prefix}.wo_b", c.hidden_size, c.o_groups * c.o_lora_rank)
    if layer_id is None or c.compress_ratios[layer_id] == 0:
        return
    if c.is_v41:
        add_v41_compression(inv, prefix, layer_id)
        return
    ratio = c.compress_ratios[layer_id]
    overlap = 2 if ratio == 4 else 1
    add_v4_compressor(inv, f"{prefix}.compressor", ratio, overlap * c.head_dim, c.head_dim)
    if ratio == 4:
        index_width = c.index_n_heads * c.index_head_dim
        inv.linear(f"{prefix}.indexer.wq_b", index_width, c.q_lora_rank)
        inv.add(f"{prefix}.indexer.weights_proj.weight", (c.index_n_heads, c.hidden_size))
        add_v4_compressor(
            inv, f"{prefix}.indexer.compressor", ratio, 2 * c.index_head_dim, c.index_head_dim
        )


def add_v4_compressor(
    inv: InventoryBuilder, prefix: str, ratio: int, width: int, head_dim: int
) -> None:
    hidden = inv.config.hidden_size
    inv.add(f"{prefix}.ape", (ratio, width), F32)
    inv.add(f"{prefix}.wkv.weight", (width, hidden))
    inv.add(f"{prefix}.wgate.weight", (width, hidden))
    inv.add(f"{prefix}.norm.weight", (head_dim,))


def add_moe(
    inv: InventoryBuilder,
    prefix: str,
    *,
    hash_routed: bool,
    n_experts: int,
    optional_bias_vl: bool = False,
) -> None:
    c = inv.config
    inter = c.moe_intermediate_size
    inv.add(f"{prefix}.gate.weight", (n_experts, c.hidden_size))
    if hash_routed:
        inv.add(f"{prefix}.gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), torch.int64)
    else:
        inv.add(f"{prefix}.gate.bias", (n_experts,), F32)
        if c.is_v41:
            inv.add(f"{prefix}.gate.bias_vl", (n_experts,), F32, optional=optional_bias_vl)
    if c.n_shared_experts:
        shared = inter * c.n_shared_experts
        inv.linear(f"{prefix}.shared_experts.w1", shared, c.hidden_size)
        inv.linear(f"{prefix}.shared_experts.w2", c.hidden_size, shared)
        inv.linear(f"{prefix}.shared_experts.w3", shared, c.hidden_size)
    for e in range(n_experts):
        inv.expert_linear(f"{prefix}.experts.{e}.w1", inter, c.hidden_size)
        inv.expert_linear(f"{prefix}.experts.{e}.w2", c.hidden_size, inter)
        inv.expert_linear(f"{prefix}.experts.{e}.w3", inter, c.hidden_size)


def add_v41_compression(inv: InventoryBuilder, prefix: str, layer_id: int) -> None:
    """CSA2 shared KV: a compressor and index keys only at kv sources, the indexer's query
    side only at index sources (spec 7.2)."""
    c = inv.config
    if c.owns_compressor(layer_id):
        inv.add(f"{prefix}.compressor.wkv.weight", (c.head_dim, c.hidden_size))
        if c.compress_ratios[layer_id] > 1:
            inv.add(f"{prefix}.compressor.wgate.weight", (c.head_dim, c.hidden_size))
        inv.add(f"{prefix}.compressor.norm.weight", (c.head_dim,))
        inv.add(f"{prefix}.indexer.wk.weight", (c.index_head_dim, c.head_dim))
        inv.add(f"{prefix}.indexer.k_norm.weight", (c.index_head_dim,))
    if c.owns_indexer(layer_id):
        index_width = c.index_n_heads * c.index_head_dim
        inv.linear(f"{prefix}.indexer.wq_b", index_width, c.q_lora_rank)
        inv.add(f"{prefix}.indexer.weights_proj.weight", (c.index_n_heads, c.hidden_size))


def add_engram(inv: InventoryBuilder, prefix: str, layer_id: int, *, unused: bool = False) -> None:
    """Engram (spec 7.3): an FP8 table with per-32 scales, its projection and gate weights.

    ``unused``: also accept the float ``embed.scale`` that transformers' ``deepseek_v41`` port
    stores next to an unquantised table; its forward reads the scale only for an FP8 table,
    so a float checkpoint's scale is validated and never loaded.
    """
    c = inv.config
    rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer_id)]
    width = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
    scale_shape = (rows, c.engram_head_dim // ENGRAM_SCALE_BLOCK)
    inv.linear(f"{prefix}.wkv", c.hidden_size * (c.hc_mult + 1), width)
    inv.add(f"{prefix}.q_weight", (c.hc_mult, c.hidden_size))
    inv.add(f"{prefix}.k_weight", (c.hc_mult, c.hidden_size))
    if inv.quant is None:
        inv.add(f"{prefix}.embed.weight", (rows, c.engram_head_dim))
        if unused:
            inv.add(f"{prefix}.embed.scale", scale_shape, optional=True, unused=FLOAT_ENGRAM_SCALE)
        return
    inv.add(f"{prefix}.embed.weight", (rows, c.engram_head_dim), FP8)
    inv.add(f"{prefix}.embed.scale", scale_shape, E8M0)


def add_mtp_stages(inv: InventoryBuilder) -> None:
    """``mtp.{s}``: the base V4 MTP block, or the DSpark stages (V4-0731, V4.1)."""
    c = inv.config
    n = c.num_mtp_layers
    is_dspark = c.dspark_block_size > 0
    for s in range(n):
        prefix = f"mtp.{s}"
        n_experts = c.dspark_n_routed_experts if is_dspark else None
        ratio = c.mtp_compress_ratios[s]
        add_block(
            inv, prefix, c.num_layers + s, ratio=ratio, n_experts=n_experts, optional_bias_vl=True
        )
        if not is_dspark:
            inv.linear(f"{prefix}.e_proj", c.hidden_size, c.hidden_size)
            inv.linear(f"{prefix}.h_proj", c.hidden_size, c.hidden_size)
            inv.add(f"{prefix}.enorm.weight", (c.hidden_size,))
            inv.add(f"{prefix}.hnorm.weight", (c.hidden_size,))
            inv.add(f"{prefix}.norm.weight", (c.hidden_size,))
            add_hc_head(inv, f"{prefix}.")
            continue
        if s == 0:
            taps = len(c.dspark_target_layer_ids)
            inv.linear(f"{prefix}.main_proj", c.hidden_size, c.hidden_size * taps)
            inv.add(f"{prefix}.main_norm.weight", (c.hidden_size,))
        if s == n - 1:
            _add_dspark_heads(inv, prefix)


def _add_dspark_heads(inv: InventoryBuilder, prefix: str) -> None:
    c = inv.config
    rank = c.dspark_markov_rank
    inv.add(f"{prefix}.norm.weight", (c.hidden_size,))
    if c.is_v41:
        inv.add(f"{prefix}.markov_head.embed.weight", (c.vocab_size, rank))
        inv.add(f"{prefix}.markov_head.head.weight", (c.vocab_size, rank))
    else:
        add_hc_head(inv, f"{prefix}.")
        inv.add(f"{prefix}.markov_head.markov_w1.weight", (c.vocab_size, rank))
        inv.add(f"{prefix}.markov_head.markov_w2.weight", (c.vocab_size, rank))
    inv.add(f"{prefix}.confidence_head.proj.weight", (1, c.hidden_size + rank))
