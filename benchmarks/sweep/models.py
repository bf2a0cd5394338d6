"""Model sources for the sweep: the embedded tiny checkpoint, dummy-weight V4-Flash / V4.1-Flash
shapes with a stated number of layers, or a local checkpoint directory."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.model.dummy_forward import v4_flash_config

REPO = Path(__file__).resolve().parents[2]

FULL_LAYERS = 43
# Published V4-Flash backbone: two sliding-only layers, then CSA/HCA alternating, CSA last.
V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: where the engine loads it from and how results are labelled."""

    name: str
    path: str
    load_format: str
    config: dict[str, Any]
    label: str
    is_v4: bool  # transformers has DeepseekV4ForCausalLM for these


def _write_config(config: dict[str, Any]) -> str:
    directory = Path(tempfile.mkdtemp(prefix="deepinfer-sweep-"))
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


V41_FLASH_TEXT = {
    "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "sliding_window": 128, "vocab_size": 129280,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
    "engram_layer_ids": [], "engram_num_embeddings": [], "dspark_target_layer_ids": [],
}  # fmt: skip
V41_FLASH_LAYERS = 40
V41_FLASH_RATIOS = [0, 0] + [2] * 18 + [1] * 20


def _v41_flash_config(layers: int) -> dict[str, Any]:
    """V4.1-Flash text shapes (``shared/specs/deepseek-v4.md``) on the embedded model's config
    layout, cut to ``layers``; no Engram tables and no DSpark stages (stated in the label)."""
    template = json.loads((REPO / "examples" / "default_model" / "config.json").read_text())
    text = {**template["text_config"], **V41_FLASH_TEXT}
    text["num_hidden_layers"] = layers
    text["compress_ratios"] = V41_FLASH_RATIOS[:layers]
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        text[key] = [i for i in text[key] if i < layers]
    sources = [i for i in text["index_source_layer_ids"] if i <= text["candidate_source_layer_id"]]
    if not sources:
        raise ValueError(f"--layers: got {layers}, expected >= 3 for v41-flash-dummy")
    text["candidate_source_layer_id"] = sources[-1]
    template["text_config"] = text
    template["image_token_id"] = 129264
    return template


def resolve_model(name: str, layers: int | None) -> ModelSource:
    """``tiny`` | ``v4-flash-dummy`` | ``v41-flash-dummy`` | a local checkpoint directory."""
    if name == "tiny":
        path = REPO / "examples" / "default_model"
        config = json.loads((path / "config.json").read_text())
        return ModelSource(name, str(path), "auto", config, "embedded tiny model", False)
    if name in ("v4-flash-dummy", "v41-flash-dummy"):
        v4 = name == "v4-flash-dummy"
        full = FULL_LAYERS if v4 else V41_FLASH_LAYERS
        layers = layers or full
        if not 1 <= layers <= full:
            raise ValueError(f"--layers: got {layers}, expected 1..{full} for {name}")
        config = v4_flash_config(V4_FLASH_RATIOS[:layers]) if v4 else _v41_flash_config(layers)
        family = "V4-Flash" if v4 else "V4.1-Flash (no Engram, no DSpark)"
        label = f"{family} shape, dummy weights, {layers} of {full} layers"
        return ModelSource(name, _write_config(config), "dummy", config, label, v4)
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model: got {name!r}, expected tiny, v4-flash-dummy, v41-flash-dummy "
            "or a checkpoint directory holding config.json"
        )
    config = json.loads((path / "config.json").read_text())
    is_v4 = config.get("model_type") == "deepseek_v4"
    return ModelSource(path.name, str(path), "auto", config, f"checkpoint {path.name}", is_v4)
