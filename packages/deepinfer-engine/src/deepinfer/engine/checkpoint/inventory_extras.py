"""Inventory parts beyond the V4 backbone: V4.1 compression and Engram, MTP / DSpark stages,
and the V4.1 vision tower (spec deepseek-v4.md sections 2.9, 2.10, 7.2 - 7.5).

The V4.1 vision tower's names and shapes follow public tensor lists of the released checkpoint
(``vision.patch_embed``, ``vision.blocks.{i}``, ``vision.norm``, ``aligner.w1/w2``,
``image_start/end/newline``); ``image_pad`` appears in only some lists and is optional.
"""

from __future__ import annotations

from deepinfer.engine.checkpoint.inventory import (
    BF16,
    E8M0,
    ENGRAM_SCALE_BLOCK,
    FP8,
    InventoryBuilder,
    add_block,
    add_hc_head,
)


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


def add_engram(inv: InventoryBuilder, prefix: str, layer_id: int) -> None:
    """Engram (spec 7.3): an FP8 table with per-32 scales, its projection and gate weights."""
    c = inv.config
    rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer_id)]
    width = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
    inv.linear(f"{prefix}.wkv", c.hidden_size * (c.hc_mult + 1), width)
    inv.add(f"{prefix}.q_weight", (c.hc_mult, c.hidden_size))
    inv.add(f"{prefix}.k_weight", (c.hc_mult, c.hidden_size))
    if inv.quant is None:
        inv.add(f"{prefix}.embed.weight", (rows, c.engram_head_dim))
        return
    inv.add(f"{prefix}.embed.weight", (rows, c.engram_head_dim), FP8)
    inv.add(f"{prefix}.embed.scale", (rows, c.engram_head_dim // ENGRAM_SCALE_BLOCK), E8M0)


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


def add_vision(inv: InventoryBuilder) -> None:
    """The V4.1 ViT and aligner (spec 7.4): validated, skipped for text-only inference."""
    c = inv.config
    v = c.vision_config or {}
    dim, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    patch, down = int(v["patch_size"]), int(v.get("downsample_ratio", 3))
    hidden = c.hidden_size

    def add(name: str, shape: tuple[int, ...], **kw) -> None:
        inv.add(name, shape, BF16, skip=True, **kw)

    add("vision.patch_embed.proj.weight", (dim, 3 * patch * patch))
    add("vision.patch_embed.proj.bias", (dim,))
    for b in range(int(v["num_hidden_layers"])):
        p = f"vision.blocks.{b}"
        add(f"{p}.norm1.weight", (dim,))
        add(f"{p}.norm2.weight", (dim,))
        add(f"{p}.attn.wqkv.weight", (3 * dim, dim))
        add(f"{p}.attn.wqkv.bias", (3 * dim,))
        add(f"{p}.attn.wo.weight", (dim, dim))
        add(f"{p}.attn.wo.bias", (dim,))
        add(f"{p}.mlp.w1.weight", (2 * inter, dim))
        add(f"{p}.mlp.w2.weight", (dim, inter))
    add("vision.norm.weight", (dim,))
    add("aligner.w1.weight", (hidden, dim * down * down))
    add("aligner.w1.bias", (hidden,))
    add("aligner.w2.weight", (hidden, hidden))
    add("aligner.w2.bias", (hidden,))
    for name in ("image_start", "image_end", "image_newline"):
        add(name, (hidden,))
    add("image_pad", (hidden,), optional=True)
