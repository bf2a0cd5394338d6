"""Inventory entries of the V4.1 vision tower and aligner (spec deepseek-v4.md section 7.4).

Names and shapes follow public tensor lists of the released checkpoint (``vision.patch_embed``,
``vision.blocks.{i}``, ``vision.norm``, ``aligner.w1/w2``, ``image_start/end/newline``);
``image_pad`` appears in only some lists and is optional (no model reads it). The specs are
marked ``skip``: the loader fills them when the model has the tower (built whenever the config
has a ``vision_config``) and skips them for a model built without it.
"""

from __future__ import annotations

from deepinfer.engine.checkpoint.inventory_builder import BF16, InventoryBuilder


def add_vision(inv: InventoryBuilder) -> None:
    """The V4.1 ViT and aligner (spec 7.4)."""
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
    add("image_pad", (hidden,), optional=True, unused="image_pad: no model reads it")
