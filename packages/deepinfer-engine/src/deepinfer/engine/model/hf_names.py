"""Tensor names as ``transformers`` writes them -> the official checkpoint names (spec 4.1).

Two forms exist. transformers 5.23 ``save_pretrained`` writes nearly official names with a
``model.`` prefix (``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, and -- a quirk of its
reverse mapping -- ``attn.norm.weight`` for the attention's ``kv_norm``). Its in-memory module
names (older writers) use ``self_attn.q_a_proj`` ... with routed experts fused
(``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``), split back into ``experts.{e}.w*``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_GLOBAL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_SAVED_KV_NORM = re.compile(r"^layers\.(\d+)\.attn\.norm\.weight$")

# (transformers suffix inside a layer, official suffix); first match wins.
_LAYER = (
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.", "attn.indexer.compressor."),
    ("self_attn.compressor.", "attn.compressor."),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
)
# Inside a compressor: transformers' names -> official.
_COMPRESSOR = {
    "kv_proj.": "wkv.",
    "gate_proj.": "wgate.",
    "position_bias": "ape",
    "kv_norm.": "norm.",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.*)$")


def official_name(name: str) -> str:
    """The official name of one non-expert transformers tensor name (KeyError if unknown)."""
    name = name.replace("weight_scale_inv", "scale").removeprefix("model.")
    if name in _GLOBAL:
        return _GLOBAL[name]
    if _SAVED_KV_NORM.match(name):
        return name.replace(".attn.norm.", ".attn.kv_norm.")
    m = _LAYER_RE.match(name)
    if m is None:
        return name  # global names already official (head.weight, norm.weight)
    layer, rest = m.groups()
    if not rest.startswith(("self_attn.", "mlp.", "attn_hc.", "ffn_hc.", "input_", "post_")):
        return name  # already official
    for hf, ours in _LAYER:
        if rest.startswith(hf):
            rest = ours + rest[len(hf) :]
            if "compressor." in ours:
                head, tail = rest.rsplit("compressor.", 1)
                for a, b in _COMPRESSOR.items():
                    if tail.startswith(a):
                        tail = b + tail[len(a) :]
                        break
                rest = head + "compressor." + tail
            return f"layers.{layer}.{rest}"
    raise KeyError(f"unrecognised transformers tensor name {name!r}")


def from_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert a whole transformers state dict to official names (experts split)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _LAYER_RE.match(name.removeprefix("model."))
        if m and m.group(2) == "mlp.experts.gate_up_proj":
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w1.weight"] = tensor[e, :inter]
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w3.weight"] = tensor[e, inter:]
        elif m and m.group(2) == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w2.weight"] = tensor[e]
        else:
            out[official_name(name)] = tensor
    return out
