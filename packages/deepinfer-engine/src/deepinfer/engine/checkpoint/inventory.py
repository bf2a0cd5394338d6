"""The tensors a checkpoint of a given config holds, in the official (hub) names and formats.

Spec deepseek-v4.md section 4.1 (V4), 2.9 / 2.10 (MTP and DSpark stages) and 7 (V4.1). Names
carry no ``model.`` prefix; an FP8 linear ``x`` is stored as ``x.weight`` (``F8_E4M3``) plus
``x.scale`` (``F8_E8M0``, one per weight block); routed experts as packed e2m1 ``x.weight``
(``I8 [out, in / 2]``) plus ``x.scale`` (``F8_E8M0 [out, in / 32]``). An unquantised checkpoint
has plain float ``x.weight`` tensors and no scales.

``official_inventory(config)`` gives ``{name: TensorSpec}`` for the whole checkpoint: backbone,
MTP / DSpark stages and (V4.1) the vision tower and aligner, whose specs are marked ``skip``
(validated, not loaded, for text-only inference).
"""

from __future__ import annotations

import torch

from deepinfer.engine.checkpoint.formats import TensorSpec
from deepinfer.engine.model.config import ModelConfig

BF16, F32 = torch.bfloat16, torch.float32
FP8, E8M0, PACKED_FP4 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8
FP4_SCALE_BLOCK = 32
ENGRAM_SCALE_BLOCK = 32


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class InventoryBuilder:
    """Collects ``{name: TensorSpec}``; knows how the config stores each kind of weight."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.quant = config.quantization
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = BF16, **kw) -> None:
        if name in self.specs:
            raise RuntimeError(f"inventory lists {name!r} twice")
        self.specs[name] = TensorSpec(tuple(int(s) for s in shape), dtype, **kw)

    def linear(self, prefix: str, out: int, inp: int, **kw) -> None:
        """An FP8 block-scaled linear when quantised, else a plain float weight."""
        if self.quant is None:
            self.add(f"{prefix}.weight", (out, inp), **kw)
            return
        bm, bn = self.quant.weight_block_size
        self.add(f"{prefix}.weight", (out, inp), FP8, **kw)
        self.add(f"{prefix}.scale", (_ceil_div(out, bm), _ceil_div(inp, bn)), E8M0, **kw)

    def expert_linear(self, prefix: str, out: int, inp: int) -> None:
        """A routed expert's weight: packed FP4 when ``expert_dtype`` is fp4."""
        if self.quant is None or self.quant.expert_dtype != "fp4":
            self.linear(prefix, out, inp)
            return
        self.add(f"{prefix}.weight", (out, inp // 2), PACKED_FP4)
        self.add(f"{prefix}.scale", (out, inp // FP4_SCALE_BLOCK), E8M0)


def official_inventory(
    config: ModelConfig, *, include_mtp: bool = True, include_vision: bool = True
) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint for ``config``: ``{official name: TensorSpec}``."""
    from deepinfer.engine.checkpoint import inventory_extras as extras

    inv = InventoryBuilder(config)
    c = config
    inv.add("embed.weight", (c.vocab_size, c.hidden_size))
    inv.add("head.weight", (c.vocab_size, c.hidden_size))
    inv.add("norm.weight", (c.hidden_size,))
    if not c.is_v41:
        add_hc_head(inv, "")
    for layer_id in range(c.num_layers):
        add_block(inv, f"layers.{layer_id}", layer_id)
        if layer_id in c.engram_layer_ids:
            extras.add_engram(inv, f"layers.{layer_id}.engram", layer_id)
    if include_mtp:
        extras.add_mtp_stages(inv)
    if include_vision and c.is_v41 and c.vision_config:
        extras.add_vision(inv)
    return inv.specs


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
        from deepinfer.engine.checkpoint.inventory_extras import add_v41_compression

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
