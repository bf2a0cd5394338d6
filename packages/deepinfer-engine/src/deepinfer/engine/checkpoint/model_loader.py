"""One call from a checkpoint (directory or hub id) to a ready model.

``load_model(path)`` resolves the path, parses ``config.json`` (``numerics="model"``: the
roundings the model defines, ``"float"``: none; see :mod:`deepinfer.engine.model.variant`),
builds the model on ``device``, fills it (validated streaming load, or ``load_format="dummy"``) and, for
V4.1, binds the Engram token map from the checkpoint's tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from deepinfer.engine.checkpoint.loader import load_into
from deepinfer.engine.checkpoint.paths import resolve_model_path
from deepinfer.engine.model.config_parsing import load_config


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    load_format: str = "auto",
    numerics: str = "model",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    revision: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> nn.Module:
    """The model of the checkpoint ``model`` (default: the default hub model), loaded.

    ``dtype`` is the dtype of the tensors the checkpoint stores as bf16 (fp32 for tight tests).
    With ``load_format="dummy"`` only the config (and tokenizer) are read, never the weights.
    """
    from deepinfer.engine.model.model import build_model

    weights = load_format != "dummy"
    directory = resolve_model_path(model, revision=revision, weights=weights)
    config = load_config(directory, numerics=numerics)
    module = build_model(config, device=device, dtype=dtype)
    load_into(
        module, directory, config=config, load_format=load_format, seed=seed, progress=progress
    )
    bind_engram_from_tokenizer(module, directory)
    return module


def bind_engram_from_tokenizer(module: nn.Module, directory: str | Path) -> None:
    """V4.1 Engram layers hash compressed token ids: derive the map from the tokenizer."""
    config = getattr(module, "config", None)
    if config is None or not config.engram_layer_ids or not hasattr(module, "bind_engram"):
        return
    from deepinfer.engine.model.engram_hashing import compressed_token_map
    from deepinfer.engine.tokenizer.tokenizer import load_tokenizer

    module.bind_engram(compressed_token_map(load_tokenizer(directory).backend))
