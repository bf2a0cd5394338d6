"""The tensors a checkpoint of a given config holds, in the official (hub) names and formats.

Spec deepseek-v4.md section 4.1 (V4), 2.9 / 2.10 (MTP and DSpark stages) and 7 (V4.1). Names
carry no ``model.`` prefix; the storage formats are :mod:`.inventory_builder`'s.

``official_inventory(config)`` gives ``{name: TensorSpec}`` for the whole checkpoint: backbone,
MTP / DSpark stages and (V4.1) the vision tower and aligner, whose specs are marked ``skip``
(validated, not loaded, for text-only inference).
"""

from __future__ import annotations

from deepinfer.engine.checkpoint.formats import TensorSpec
from deepinfer.engine.checkpoint.inventory_builder import ENGRAM_SCALE_BLOCK, InventoryBuilder
from deepinfer.engine.checkpoint.inventory_layers import (
    add_block,
    add_engram,
    add_hc_head,
    add_mtp_stages,
)
from deepinfer.engine.checkpoint.inventory_vision import add_vision
from deepinfer.engine.model.config import ModelConfig

__all__ = ["ENGRAM_SCALE_BLOCK", "official_inventory"]


def official_inventory(
    config: ModelConfig,
    *,
    include_mtp: bool = True,
    include_vision: bool = True,
    include_unused: bool = False,
) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint for ``config``: ``{official name: TensorSpec}``.

    ``include_unused`` adds the optional tensors other writers store that the model never
    reads (specs with ``unused`` set): what a checkpoint may hold, for validation.
    """
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
            add_engram(inv, f"layers.{layer_id}.engram", layer_id, unused=include_unused)
    if include_mtp:
        add_mtp_stages(inv)
    if include_vision and c.is_v41 and c.vision_config:
        add_vision(inv)
    return inv.specs
