"""Random checkpoints of any config, in the official on-disk format, with a tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.checkpoint.inventory import official_inventory
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing.vision_configs import tiny_vision_config
from deepinfer.engine.testing.writer import (
    DEFAULT_SHARD_BYTES,
    _is_written_scale,
    _logical_shape,
    with_quantization,
    write_checkpoint,
)

# A tokenizer needs its 17 special tokens, 256 byte symbols and at least one merge.
MIN_TOKENIZER_VOCAB = 274
MAX_TOKENIZER_VOCAB = 512


def random_state_dict(
    config: ModelConfig | Mapping[str, Any],
    *,
    seed: int = 0,
    include_mtp: bool = True,
    include_vision: bool = True,
) -> dict[str, torch.Tensor]:
    """Random fp32 values (``tid2eid``: int64) for every weight of ``config``, official names,
    without ``.scale`` entries: the input :func:`write_checkpoint` quantises."""
    if not isinstance(config, ModelConfig):
        config = parse_config(config)
    inventory = official_inventory(config, include_mtp=include_mtp, include_vision=include_vision)
    tensors = {}
    for name, spec in inventory.items():
        if _is_written_scale(name, inventory) or spec.unused:
            continue
        dtype = torch.int64 if name.endswith("tid2eid") else torch.float32
        tensors[name] = torch.empty(_logical_shape(spec), dtype=dtype)
    fill_dummy(tensors, seed=seed)
    # Norm weights are ones in a dummy fill; make them random so a test that swaps two of
    # them, or loads one into the wrong place, can tell.
    generator = torch.Generator().manual_seed(seed + 1)
    for name, t in tensors.items():
        if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=generator))
        elif name.endswith(".gate.bias_vl") or (
            name.startswith(("vision.", "aligner.")) and name.endswith(".bias")
        ):
            # dummy biases are zeros; image tokens must route and project differently
            t.copy_(0.1 * torch.randn(t.shape, generator=generator))
    return tensors


def make_random_checkpoint(
    directory: str | Path,
    config: Mapping[str, Any],
    *,
    quantized: bool,
    seed: int = 0,
    float_dtype: torch.dtype | None = None,
    tokenizer: bool | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    vision: bool | None = None,
) -> Path:
    """Write a random checkpoint of ``config`` (a ``config.json`` dict) into ``directory``.

    ``quantized`` adds (or removes) the ``quantization_config`` the real checkpoints carry:
    FP8 block weights, FP4 routed experts, FP8 Engram tables. ``float_dtype`` stores every
    unquantised float tensor in that dtype (fp32 for tight comparisons). ``tokenizer``: write
    the tiny test tokenizer (default: when the vocabulary has room for it). ``vision`` (V4.1):
    True writes a vision tower (the config's ``vision_config``, else a one-block tiny one),
    False drops it, None follows the config.
    """
    raw = with_vision(with_quantization(config, quantized), vision)
    parsed = parse_config(raw)
    tensors = random_state_dict(parsed, seed=seed)
    path = write_checkpoint(
        directory, raw, tensors, float_dtype=float_dtype, max_shard_bytes=max_shard_bytes
    )
    if tokenizer is None:
        tokenizer = parsed.vocab_size >= MIN_TOKENIZER_VOCAB
    if tokenizer:
        write_testing_tokenizer(path, parsed.vocab_size)
    return path


def with_vision(raw: Mapping[str, Any], vision: bool | None) -> dict[str, Any]:
    """``raw`` with its ``vision_config`` kept (None), ensured (True) or removed (False)."""
    raw = dict(raw)
    if vision is False:
        raw.pop("vision_config", None)
    elif vision and not raw.get("vision_config"):
        if "text_config" not in raw:
            raise ValueError(
                "vision=True: only V4.1 checkpoints (text_config / vision_config) have a tower"
            )
        raw["vision_config"] = tiny_vision_config()
    return raw


def write_testing_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """The tokenizer helper's tiny byte-level BPE (V4 special tokens at 0..16), sized to fit
    the model's vocabulary."""
    if vocab_size < MIN_TOKENIZER_VOCAB:
        raise ValueError(
            f"vocab_size = {vocab_size}: the test tokenizer needs at least {MIN_TOKENIZER_VOCAB}"
        )
    testing_tokenizer_for(vocab_size).save(directory)


def testing_tokenizer_for(vocab_size: int):
    """The test tokenizer written next to a checkpoint of ``vocab_size`` (at most 512 ids)."""
    from deepinfer.engine.tokenizer.training import testing_tokenizer

    return testing_tokenizer(min(vocab_size, MAX_TOKENIZER_VOCAB))
