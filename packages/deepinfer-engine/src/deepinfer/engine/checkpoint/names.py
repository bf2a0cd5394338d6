"""Tensor names: the official (hub) spelling and the spellings ``transformers`` uses.

Three spellings reach the loader (spec deepseek-v4.md section 4.1):

- official, as on the hub: ``layers.3.attn.wq_a.weight``, ``hc_head_fn``, experts one by one;
- ``transformers``' module names: ``model.layers.3.self_attn.q_a_proj.weight``,
  ``model.hc_head.hc_fn``, routed experts fused into ``mlp.experts.gate_up_proj [E, 2I, D]``
  (gate rows first) and ``mlp.experts.down_proj [E, D, I]``, FP8 scales as ``weight_scale_inv``;
- what ``save_pretrained`` writes (transformers >= 5.2x reverses most renames on save): a
  ``model.`` prefix, official leaf names, per-expert tensors, and ``attn.norm`` for the
  attention's ``kv_norm``.

:func:`official_name` maps any of them to the official name; fused expert tensors map to one
slice per expert and projection (:func:`split_fused_experts`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Applied in order to the name without its ``model.`` prefix; each leaves official names alone.
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^embed_tokens\.", "embed."),
        (r"^lm_head\.", "head."),
        (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.", ".ffn."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        (r"\.sinks$", ".attn_sink"),
        (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
        (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
        (r"\.compressor\.indexer\.", ".indexer.compressor."),
        (r"\.position_bias$", ".ape"),
        (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
        (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
        (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
        (r"\.q_a_proj\.", ".wq_a."),
        (r"\.q_b_proj\.", ".wq_b."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.gate_proj\.", ".wgate."),
        (r"\.o_a_proj\.", ".wo_a."),
        (r"\.o_b_proj\.", ".wo_b."),
        (r"\.q_a_norm\.", ".q_norm."),
        (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
        (r"\.compressor\.kv_norm\.", ".compressor.norm."),
        (r"\.attn\.norm\.", ".attn.kv_norm."),
        (r"\.weight_scale_inv$", ".scale"),
    )
)
# Names of the V4.1 vision tower and aligner: never renamed (``mlp`` there is not the MoE).
_UNTOUCHED = re.compile(r"^(vision\.|aligner\.|image_)")
_FUSED = re.compile(r"^(?P<prefix>.+\.ffn\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def official_name(name: str) -> str:
    """The official spelling of a tensor name in any of the accepted spellings."""
    name = name.removeprefix("model.")
    if _UNTOUCHED.match(name):
        return name
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


@dataclass(frozen=True)
class ExpertSlice:
    """Where one official expert tensor lives inside a fused ``[E, rows, cols]`` tensor."""

    expert: int
    row_start: int
    row_end: int


def is_fused_experts(official: str) -> bool:
    return _FUSED.match(official) is not None


def split_fused_experts(
    official: str, shape: tuple[int, ...]
) -> list[tuple[str, ExpertSlice, tuple[int, int]]]:
    """``(official expert name, slice, shape)`` for every expert projection in a fused tensor.

    ``gate_up_proj [E, 2I, D]`` holds ``w1`` (gate) in rows ``[0, I)`` and ``w3`` (up) in rows
    ``[I, 2I)``; ``down_proj [E, D, I]`` holds ``w2``.
    """
    match = _FUSED.match(official)
    if match is None or len(shape) != 3:
        raise ValueError(f"{official!r} {list(shape)}: expected a fused [E, rows, cols] tensor")
    prefix, kind = match["prefix"], match["kind"]
    experts, rows, cols = shape
    if kind == "down_proj":
        parts = [("w2", 0, rows)]
    else:
        if rows % 2:
            raise ValueError(f"{official!r} {list(shape)}: gate_up rows must be even")
        parts = [("w1", 0, rows // 2), ("w3", rows // 2, rows)]
    return [
        (f"{prefix}.{e}.{proj}.weight", ExpertSlice(e, start, end), (end - start, cols))
        for e in range(experts)
        for proj, start, end in parts
    ]
