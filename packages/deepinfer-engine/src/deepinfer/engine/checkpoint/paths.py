"""Where a model's checkpoint lives: a local directory, or a hub id fetched into the HF cache.

Resolution order:

1. ``model`` is an existing directory: use it (an explicit argument beats the environment);
2. ``DEEPINFER_HF_MODEL_DIR`` is set: use that directory instead of downloading anything;
3. ``model`` (default :data:`DEFAULT_MODEL`) is a hub id: ``huggingface_hub.snapshot_download``
   into the HF cache (``HF_HOME`` / ``HF_HUB_CACHE`` apply), with a progress bar; a snapshot
   already in the cache is not fetched again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from deepinfer.engine.checkpoint.index import CheckpointError
from deepinfer.kernels import envs

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
ENV_MODEL_DIR = "DEEPINFER_HF_MODEL_DIR"
# What a text-only engine needs from a snapshot (no images of the model card, no .bin).
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")
CONFIG_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja")  # no weights (load_format=dummy)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _checked_dir(path: Path, origin: str) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"{origin} = {str(path)!r}: expected an existing directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{origin} = {str(path)!r}: expected a config.json in it")
    return path


def resolve_model_path(
    model: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    download: bool = True,
    weights: bool = True,
) -> Path:
    """The local checkpoint directory for ``model`` (a directory or a hub id).

    ``weights=False`` fetches only the config and tokenizer files of a hub snapshot.
    """
    if model is not None and Path(model).is_dir():
        return _checked_dir(Path(model), "model")
    override = envs.get(ENV_MODEL_DIR)
    if override:
        return _checked_dir(Path(override).expanduser(), ENV_MODEL_DIR)
    repo_id = DEFAULT_MODEL if model is None else os.fspath(model)
    if not _HUB_ID.match(repo_id):
        raise CheckpointError(
            f"model = {repo_id!r}: expected an existing directory or a hub id like "
            f"'{DEFAULT_MODEL}'"
        )
    if not download:
        raise CheckpointError(f"model = {repo_id!r} is not a local directory and download=False")
    patterns = DOWNLOAD_PATTERNS if weights else CONFIG_PATTERNS
    return _checked_dir(_download(repo_id, revision, patterns), f"snapshot of {repo_id}")


def _download(repo_id: str, revision: str | None, patterns: tuple[str, ...]) -> Path:
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=list(patterns))
    return Path(path)
