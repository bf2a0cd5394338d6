"""Reading a checkpoint's ``config.json`` into a :class:`~deepinfer.engine.model.config.ModelConfig`.

Three input shapes are accepted and normalised to one frozen config:

- the flat V4 file as published (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``,
  ``qk_rope_head_dim``);
- the nested V4.1 file (``DeepseekV41ForCausalLM`` with ``text_config`` / ``vision_config``);
- the normalised form ``transformers`` writes with ``save_pretrained`` (``layer_types``,
  ``mlp_layer_types``, ``compress_rates``, ``rope_parameters``, ``partial_rotary_factor``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from deepinfer.engine.model.config import (
    ARCHITECTURES,
    V4_ARCH,
    V4_CSA_RATIO,
    V41_ARCH,
    ConfigError,
    ModelConfig,
    QuantConfig,
    RopeScaling,
)

LAYER_TYPE_TO_RATIO_KEY = {
    "sliding_attention": None,
    "compressed_sparse_attention": "compressed_sparse_attention",
    "heavily_compressed_attention": "heavily_compressed_attention",
}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# (our field, config.json key, default); a default of ... means required.
_SCALARS: tuple[tuple[str, str, Any], ...] = (
    ("vocab_size", "vocab_size", ...),
    ("hidden_size", "hidden_size", ...),
    ("num_layers", "num_hidden_layers", ...),
    ("num_heads", "num_attention_heads", ...),
    ("head_dim", "head_dim", ...),
    ("q_lora_rank", "q_lora_rank", ...),
    ("o_groups", "o_groups", 8),
    ("o_lora_rank", "o_lora_rank", ...),
    ("sliding_window", "sliding_window", 128),
    ("rope_theta", "rope_theta", 10000.0),
    ("compress_rope_theta", "compress_rope_theta", 160000.0),
    ("max_position_embeddings", "max_position_embeddings", 1048576),
    ("index_n_heads", "index_n_heads", 64),
    ("index_head_dim", "index_head_dim", 128),
    ("index_topk", "index_topk", 512),
    ("n_routed_experts", "n_routed_experts", ...),
    ("n_shared_experts", "n_shared_experts", 1),
    ("num_experts_per_tok", "num_experts_per_tok", ...),
    ("moe_intermediate_size", "moe_intermediate_size", ...),
    ("scoring_func", "scoring_func", "sqrtsoftplus"),
    ("norm_topk_prob", "norm_topk_prob", True),
    ("routed_scaling_factor", "routed_scaling_factor", 1.5),
    ("swiglu_limit", "swiglu_limit", 10.0),
    ("hc_mult", "hc_mult", 4),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters", 20),
    ("hc_eps", "hc_eps", 1e-6),
    ("rms_norm_eps", "rms_norm_eps", 1e-6),
    ("num_nextn_predict_layers", "num_nextn_predict_layers", 0),
    ("tie_word_embeddings", "tie_word_embeddings", False),
    ("bos_token_id", "bos_token_id", 0),
    ("eos_token_id", "eos_token_id", 1),
    ("pad_token_id", "pad_token_id", None),
    ("candidate_source_layer_id", "candidate_source_layer_id", None),
    ("candidate_topk_blocks", "candidate_topk_blocks", 0),
    ("candidate_block_size", "candidate_block_size", 0),
    ("gate_temp", "gate_temp", 1.0),
    ("engram_max_ngram_size", "engram_max_ngram_size", 0),
    ("engram_vocab_size", "engram_vocab_size", 0),
    ("engram_n_heads", "engram_n_heads", 0),
    ("engram_head_dim", "engram_head_dim", 0),
    ("engram_pad_token_id", "engram_pad_token_id", None),
    ("engram_compressed_vocab_size", "engram_compressed_vocab_size", 0),
    ("dspark_block_size", "dspark_block_size", 0),
    ("dspark_noise_token_id", "dspark_noise_token_id", None),
    ("dspark_markov_rank", "dspark_markov_rank", 0),
    ("dspark_n_routed_experts", "dspark_n_routed_experts", None),
    ("dspark_num_experts_per_tok", "dspark_num_experts_per_tok", None),
    ("dspark_confidence_temperature", "dspark_confidence_temperature", 1.0),
)
_INT_LISTS = (
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)


def _fail(name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"config field {name!r} = {value!r}: expected {expected}")


def load_config(path: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
    """Read ``config.json`` from a file or checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return parse_config(raw, **overrides)


def parse_config(raw: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Normalise any accepted ``config.json`` dict into a :class:`ModelConfig`."""
    arch = _architecture(raw)
    text = dict(raw.get("text_config") or raw) if arch == V41_ARCH else dict(raw)
    if arch == V41_ARCH:
        for key in ("quantization_config", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key in raw and key not in text:
                text[key] = raw[key]
    fields = text_fields(text, arch)
    if arch == V41_ARCH:
        fields["image_token_id"] = raw.get("image_token_id")
        fields["vision_config"] = raw.get("vision_config")
    if "quant_simulation" in overrides:
        raise ConfigError(
            "quant_simulation was replaced by numerics: 'model' (the default: the roundings "
            "the model defines) or 'float' (none)"
        )
    fields.update(overrides)
    return ModelConfig(architecture=arch, **fields)


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            _fail("architectures", archs, f"one of {ARCHITECTURES}")
        return known[0]
    model_type = raw.get("model_type")
    by_type = {"deepseek_v4": V4_ARCH, "deepseek_v41": V41_ARCH, "deepseek_v41_text": V41_ARCH}
    if model_type not in by_type:
        _fail("model_type", model_type, f"one of {sorted(by_type)} (no 'architectures' given)")
    return by_type[model_type]


def text_fields(text: Mapping[str, Any], arch: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ours, key, default in _SCALARS:
        if key in text and text[key] is not None:
            out[ours] = text[key]
        elif default is ...:
            _fail(key, None, "a value (required field missing)")
        else:
            out[ours] = default
    if out["engram_pad_token_id"] is None and text.get("engram_pad_id") is not None:
        out["engram_pad_token_id"] = text["engram_pad_id"]  # transformers' spelling
    if out["candidate_source_layer_id"] is not None and out["candidate_source_layer_id"] < 0:
        out["candidate_source_layer_id"] = None  # negative disables the candidate pre-filter
    if isinstance(out["eos_token_id"], list):
        out["eos_token_id"] = out["eos_token_id"][0] if out["eos_token_id"] else None
    for key in _INT_LISTS:
        out[key] = tuple(int(v) for v in (text.get(key) or ()))
    n = out["num_layers"]
    out["rope_head_dim"] = _rope_head_dim(text, out["head_dim"])
    ratios = _compress_ratios(text, n, arch)
    out["compress_ratios"], out["mtp_compress_ratios"] = ratios[:n], ratios[n:]
    out["num_hash_layers"] = _num_hash_layers(text, n, arch)
    out["rope_scaling"], thetas = _rope(text)
    out.update(thetas)
    out["quantization"] = _quantization(text)
    return out


def _rope_head_dim(text: Mapping[str, Any], head_dim: int) -> int:
    if text.get("qk_rope_head_dim") is not None:
        return int(text["qk_rope_head_dim"])
    factor = text.get("partial_rotary_factor")
    if factor is not None:
        return int(round(head_dim * factor))
    return 64


def _compress_ratios(text: Mapping[str, Any], n: int, arch: str) -> tuple[int, ...]:
    if text.get("compress_ratios") is not None:
        ratios = tuple(int(r) for r in text["compress_ratios"])
        if len(ratios) < n:
            _fail("compress_ratios", ratios, f"at least num_hidden_layers={n} entries")
        return ratios
    layer_types = text.get("layer_types")
    if layer_types is None:
        _fail("compress_ratios", None, "compress_ratios or layer_types")
    rates = {**DEFAULT_COMPRESS_RATES, **(text.get("compress_rates") or {})}
    ratios = []
    for t in layer_types:
        if t not in LAYER_TYPE_TO_RATIO_KEY:
            _fail("layer_types", t, f"one of {sorted(LAYER_TYPE_TO_RATIO_KEY)}")
        key = LAYER_TYPE_TO_RATIO_KEY[t]
        ratios.append(0 if key is None else int(rates[key]))
    if len(ratios) != n:
        _fail("layer_types", layer_types, f"{n} entries (num_hidden_layers)")
    if arch == V4_ARCH:
        _check_v4_rates(rates, set(layer_types))
    return tuple(ratios)


def _check_v4_rates(rates: Mapping[str, Any], used: set[str]) -> None:
    """V4's layer kinds are told apart by ratio (:data:`V4_CSA_RATIO` is CSA): refuse rates
    that would blur them."""
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    if csa in used and int(rates[csa]) != V4_CSA_RATIO:
        _fail(
            f"compress_rates[{csa!r}]",
            rates[csa],
            f"{V4_CSA_RATIO}: the engine tells CSA layers (overlapping windows, indexer) from HCA "
            f"layers by ratio, as V4's flat compress_ratios does",
        )
    if hca in used and not (int(rates[hca]) > 0 and int(rates[hca]) != V4_CSA_RATIO):
        _fail(
            f"compress_rates[{hca!r}]",
            rates[hca],
            f"a ratio > 0 other than {V4_CSA_RATIO} (the CSA ratio: layer kinds are told apart "
            f"by ratio)",
        )


def _num_hash_layers(text: Mapping[str, Any], n: int, arch: str) -> int:
    if text.get("num_hash_layers") is not None:
        return int(text["num_hash_layers"])
    mlp = text.get("mlp_layer_types")
    if mlp is None:
        return 0 if arch == V41_ARCH else min(3, n)
    if len(mlp) != n or any(t not in ("hash_moe", "moe") for t in mlp):
        _fail("mlp_layer_types", mlp, f"{n} entries of 'hash_moe' / 'moe'")
    count = sum(t == "hash_moe" for t in mlp)
    if any(t != "hash_moe" for t in mlp[:count]):
        _fail("mlp_layer_types", mlp, "the hash_moe layers first, then moe")
    return count


def _yarn(params: Mapping[str, Any] | None) -> RopeScaling | None:
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        _fail("rope_scaling.type", kind, "yarn or default")
    return RopeScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast", 32)),
        beta_slow=float(params.get("beta_slow", 1)),
    )


def _rope(text: Mapping[str, Any]) -> tuple[RopeScaling | None, dict[str, float]]:
    thetas = {
        "rope_theta": float(text.get("rope_theta") or 10000.0),
        "compress_rope_theta": float(text.get("compress_rope_theta") or 160000.0),
    }
    params = text.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = params.get("main") or {}, params["compress"]
        thetas["rope_theta"] = float(main.get("rope_theta", thetas["rope_theta"]))
        thetas["compress_rope_theta"] = float(compress.get("rope_theta"))
        return _yarn(compress), thetas
    if text.get("rope_scaling"):
        return _yarn(text["rope_scaling"]), thetas
    if isinstance(params, Mapping):
        return _yarn(params), thetas
    return None, thetas


def _quantization(text: Mapping[str, Any]) -> QuantConfig | None:
    q = text.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method", "fp8") != "fp8":
        _fail("quantization_config.quant_method", q.get("quant_method"), "fp8")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        _fail("quantization_config.weight_block_size", block, "two integers")
    expert_dtype = q.get("expert_dtype") or text.get("expert_dtype") or "fp8"
    if expert_dtype not in ("fp4", "fp8"):
        _fail("expert_dtype", expert_dtype, "fp4 or fp8")
    return QuantConfig(
        weight_block_size=(int(block[0]), int(block[1])),
        scale_fmt=q.get("scale_fmt", "ue8m0"),
        expert_dtype=expert_dtype,
    )
