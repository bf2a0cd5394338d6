"""Checkpoints: from a directory or hub id to a model's parameters.

- :func:`resolve_model_path`: local directory, ``DEEPINFER_HF_MODEL_DIR``, or a hub download.
- :func:`read_checkpoint_index`: every tensor's name / shape / dtype from the safetensors
  headers (official names, whatever spelling the files use), reading no data.
- :func:`official_inventory`: what a checkpoint of a config must hold.
- :func:`validate_checkpoint`: one error naming every missing, unexpected, mis-shaped and
  wrong-dtype tensor.
- :func:`load_into`: validate, then stream the tensors shard by shard into a module;
  ``load_format="dummy"`` fills random weights instead (:func:`fill_dummy`).
- :func:`load_model`: all of the above plus config parsing, ``build_model`` and the V4.1
  Engram token map: one call from a path or hub id to a ready model.
"""

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.checkpoint.formats import TensorSpec
from deepinfer.engine.checkpoint.index import (
    CheckpointError,
    StoredTensor,
    read_checkpoint_index,
    read_safetensors_header,
    shard_files,
)
from deepinfer.engine.checkpoint.inventory import official_inventory
from deepinfer.engine.checkpoint.loader import (
    LoadReport,
    load_into,
    read_and_validate,
    read_tensors,
)
from deepinfer.engine.checkpoint.model_loader import bind_engram_from_tokenizer, load_model
from deepinfer.engine.checkpoint.names import official_name
from deepinfer.engine.checkpoint.paths import DEFAULT_MODEL, resolve_model_path
from deepinfer.engine.checkpoint.validate import (
    CheckpointMismatchError,
    Mismatch,
    validate_checkpoint,
)

__all__ = [
    "DEFAULT_MODEL",
    "CheckpointError",
    "CheckpointMismatchError",
    "LoadReport",
    "Mismatch",
    "StoredTensor",
    "TensorSpec",
    "bind_engram_from_tokenizer",
    "fill_dummy",
    "load_into",
    "load_model",
    "official_inventory",
    "official_name",
    "read_and_validate",
    "read_checkpoint_index",
    "read_safetensors_header",
    "read_tensors",
    "resolve_model_path",
    "shard_files",
    "validate_checkpoint",
]
