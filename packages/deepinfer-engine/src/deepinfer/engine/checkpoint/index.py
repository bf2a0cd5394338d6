"""What a checkpoint directory holds, read from the safetensors headers alone.

A safetensors file starts with an 8-byte little-endian header length and a JSON header
(``{name: {dtype, shape, data_offsets}}``); we read only that, never tensor data, so a
checkpoint can be validated in full before a single weight is loaded. Shards are found through
``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
``*.safetensors`` file of the directory.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.checkpoint.formats import SAFETENSORS_DTYPES
from deepinfer.engine.checkpoint.names import (
    ExpertSlice,
    is_fused_experts,
    official_name,
    split_fused_experts,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 512 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint directory or file is unreadable or inconsistent."""


@dataclass(frozen=True)
class StoredTensor:
    """One official tensor as stored: file, key and (for fused experts) the slice of it."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert_slice: ExpertSlice | None = None


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """``{key: {"dtype", "shape", "data_offsets"}}`` of one file; reads the header only."""
    path = Path(path)
    with open(path, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw_length)
        if length > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is not plausible")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header


def shard_files(directory: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in a stable order."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' missing or empty")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shards that do not exist: {absent}")
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors")
    return files


def _check_weight_map(directory: Path, headers: dict[Path, dict[str, dict]]) -> None:
    """The index's ``weight_map`` must name, for every key, the shard that holds it."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    listed = json.loads(index.read_text())["weight_map"]
    actual = {key: path.name for path, header in headers.items() for key in header}
    wrong = sorted(k for k in listed if actual.get(k) != listed[k])
    unlisted = sorted(k for k in actual if k not in listed)
    if wrong or unlisted:
        raise CheckpointError(
            f"{index} disagrees with the shard headers: {len(wrong)} keys not in the shard it "
            f"names ({wrong[:5]}), {len(unlisted)} stored keys not listed ({unlisted[:5]})"
        )


def _dtype(path: Path, key: str, name: str) -> torch.dtype:
    if name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {name!r}")
    return SAFETENSORS_DTYPES[name]


def read_checkpoint_index(directory: str | Path) -> dict[str, StoredTensor]:
    """``{official name: StoredTensor}`` for every tensor of the checkpoint, headers only.

    Any accepted spelling (official, ``transformers``' module names, ``save_pretrained``'s) is
    mapped to the official name; fused expert tensors become one entry per expert projection.
    """
    found: dict[str, StoredTensor] = {}
    headers = {path: read_safetensors_header(path) for path in shard_files(directory)}
    _check_weight_map(Path(directory), headers)
    for path, header in headers.items():
        for key, info in header.items():
            dtype = _dtype(path, key, info["dtype"])
            shape = tuple(int(s) for s in info["shape"])
            official = official_name(key)
            if is_fused_experts(official):
                entries = [
                    (name, StoredTensor(path, key, part_shape, dtype, part))
                    for name, part, part_shape in split_fused_experts(official, shape)
                ]
            else:
                entries = [(official, StoredTensor(path, key, shape, dtype))]
            for name, stored in entries:
                if name in found:
                    first = found[name]
                    raise CheckpointError(
                        f"tensor {name!r} is stored twice: {first.file.name}:{first.key} and "
                        f"{path.name}:{key}"
                    )
                found[name] = stored
    return found
