"""Write checkpoints in the official on-disk format, from float tensors in official names.

``write_checkpoint(directory, config, tensors)`` quantises what the config's
``quantization_config`` says is quantised (FP8 e4m3 with ue8m0 block scales, packed FP4 routed
experts with per-32 scales, FP8 Engram tables with per-32 row scales) and writes sharded
safetensors with ``model.safetensors.index.json``, ``config.json`` and
``generation_config.json`` — the layout of the published checkpoints (spec sections 1 and 4).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import deepinfer.kernels as K
from deepinfer.engine.checkpoint.formats import TensorSpec
from deepinfer.engine.checkpoint.inventory import ENGRAM_SCALE_BLOCK, official_inventory
from deepinfer.engine.model.config import V41_ARCH, ModelConfig
from deepinfer.engine.model.config_parsing import parse_config

DEFAULT_SHARD_BYTES = 4 * 1024 * 1024
V4_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
V41_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


def with_quantization(config: Mapping[str, Any], quantized: bool) -> dict[str, Any]:
    """A copy of a ``config.json`` dict with (as the real checkpoints have it) or without the
    quantisation fields. V4 keeps ``expert_dtype`` at the top level, V4.1 inside
    ``quantization_config`` (spec 1.1, 1.3)."""
    out = copy.deepcopy(dict(config))
    is_v41 = V41_ARCH in (out.get("architectures") or ()) or out.get("model_type") == "deepseek_v41"
    holders = [out] + ([out["text_config"]] if isinstance(out.get("text_config"), dict) else [])
    for holder in holders:
        holder.pop("quantization_config", None)
        holder.pop("expert_dtype", None)
    if quantized:
        if is_v41:
            out["quantization_config"] = copy.deepcopy(V41_QUANTIZATION)
        else:
            out["quantization_config"] = copy.deepcopy(V4_QUANTIZATION)
            out["expert_dtype"] = "fp4"
    return out


def _stored_tensors(
    name: str, value: torch.Tensor, spec: TensorSpec, config: ModelConfig, float_dtype
) -> dict[str, torch.Tensor]:
    """The tensors one official weight becomes on disk (itself, or codes plus scales)."""
    base = name.removesuffix(".weight")
    if spec.dtype == torch.float8_e4m3fn:
        if name.endswith("engram.embed.weight"):
            block = (1, ENGRAM_SCALE_BLOCK)
        else:
            block = config.weight_block
        codes, scale = K.fp8_block_quant(value.float(), block)
        return {name: codes, f"{base}.scale": scale}
    if spec.dtype == torch.int8:
        packed, scale = K.fp4_quant(value.float(), 32)
        return {name: packed, f"{base}.scale": scale}
    if spec.is_float:
        return {name: value.to(float_dtype or spec.dtype)}
    return {name: value.to(spec.dtype)}


def _check_names(
    tensors: Mapping[str, torch.Tensor], wanted: list[str], allowed: Mapping[str, TensorSpec]
) -> None:
    missing = sorted(set(wanted) - set(tensors))
    extra = sorted(set(tensors) - set(wanted) - set(allowed))
    if missing or extra:
        raise ValueError(
            f"tensors do not match the config's inventory: missing {missing[:10]} "
            f"({len(missing)}), unexpected {extra[:10]} ({len(extra)})"
        )


def write_checkpoint(
    directory: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    float_dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    unused: bool = False,
) -> Path:
    """Write ``tensors`` (official names, float values, no ``.scale`` entries) as a checkpoint.

    ``config`` is the ``config.json`` dict; its ``quantization_config`` decides the format.
    ``float_dtype`` overrides the stored dtype of every unquantised float tensor (default: the
    official one, BF16 or F32 per tensor). ``unused=True`` also writes the tensors other
    writers store that the model never reads, in their form: the ``embed.scale`` next to each
    float Engram table, as transformers' ``deepseek_v41`` port saves it (its values from
    ``tensors`` where given there, else ones, the port's initial value). Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    parsed = parse_config(config)
    inventory = official_inventory(parsed, include_unused=unused)
    extras = {n: s for n, s in inventory.items() if s.unused}
    wanted = [n for n, s in inventory.items() if not _is_written_scale(n, inventory)]
    wanted = [n for n in wanted if n not in extras]
    _check_names(tensors, wanted, extras)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in wanted:
        value = tensors[name]
        if tuple(value.shape) != _logical_shape(inventory[name]):
            raise ValueError(
                f"tensor {name!r} has shape {list(value.shape)}; expected "
                f"{list(_logical_shape(inventory[name]))}"
            )
        stored = _stored_tensors(name, value, inventory[name], parsed, float_dtype)
        stored.update(_extras_of(name, tensors, extras, float_dtype))
        size = sum(t.numel() * t.element_size() for t in stored.values())
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1].update({k: v.contiguous() for k, v in stored.items()})
        shard_bytes += size
    _write_shards(directory, shards)
    _write_json(directory / "config.json", dict(config))
    _write_json(directory / "generation_config.json", _generation_config(parsed))
    return directory


def _extras_of(
    name: str, tensors: Mapping[str, torch.Tensor], extras: Mapping[str, TensorSpec], float_dtype
) -> dict[str, torch.Tensor]:
    """The unused ``.scale`` stored next to weight ``name`` (in the same shard), if any."""
    scale = name.removesuffix(".weight") + ".scale"
    if not name.endswith(".weight") or scale not in extras:
        return {}
    spec = extras[scale]
    value = tensors.get(scale, torch.ones(spec.shape))
    if tuple(value.shape) != spec.shape:
        raise ValueError(
            f"tensor {scale!r} has shape {list(value.shape)}; expected {list(spec.shape)}"
        )
    return {scale: value.to(float_dtype or spec.dtype)}


def _is_written_scale(name: str, inventory: Mapping[str, TensorSpec]) -> bool:
    """Scales are produced by quantising their weight, never passed in."""
    return name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in inventory


def _logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The float shape of a tensor whose stored form is ``spec`` (packed FP4 holds two)."""
    if spec.dtype == torch.int8:
        return (*spec.shape[:-1], spec.shape[-1] * 2)
    return spec.shape


def _write_shards(directory: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(directory / "model.safetensors.index.json", index)


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    return {
        "_from_model_config": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
