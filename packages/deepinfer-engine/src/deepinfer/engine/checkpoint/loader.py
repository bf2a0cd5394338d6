"""Load a checkpoint into a model: validate everything first, then stream shard by shard.

``load_into(module, path)``: resolve the path (directory or hub id), read every shard's header,
validate names / shapes / dtypes against the config's inventory (one error naming everything
wrong, before any data is read), then copy tensors into the module's parameters one shard at a
time, each tensor read just before it is copied.

A module parameter receives the stored tensor as is when the dtypes agree, cast when both are
float, and dequantised when the module keeps a float copy of a quantised weight (FP8 block or
packed FP4, using the stored ``.scale``). The V4.1 vision tower and the MTP / DSpark stages
are validated and skipped when the module was built without them, and so are the tensors other
writers store that the model never reads (the Engram table scale of a float V4.1 checkpoint
written by transformers: its port reads the scale only for an FP8 table). An expert-parallel
model reads only its rank's routed experts; tensors left on the meta device (host Engram tables
placed in node shared memory afterwards) are skipped and filled by :func:`fill_tensors`.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

import deepinfer.kernels as K
from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.checkpoint.formats import FLOAT_FAMILY, TensorSpec, as_specs, dtype_name
from deepinfer.engine.checkpoint.index import CheckpointError, StoredTensor, read_checkpoint_index
from deepinfer.engine.checkpoint.inventory import ENGRAM_SCALE_BLOCK, official_inventory
from deepinfer.engine.checkpoint.paths import resolve_model_path
from deepinfer.engine.checkpoint.validate import validate_checkpoint
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.expert_parallel import held_elsewhere

logger = logging.getLogger("deepinfer.engine.checkpoint")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Groups of tensors a module may be built without (text-only, no speculative decoding).
OPTIONAL_PREFIXES = ("mtp.",)
_INDEX_FAMILY = frozenset({torch.int64, torch.int32})
FILL_SLICE_BYTES = 1 << 30


@dataclass
class LoadReport:
    """What a load did: how many tensors were copied and which were skipped, and why."""

    directory: Path | None
    loaded: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)


def read_and_validate(
    directory: Path, config: ModelConfig, inventory: Mapping[str, TensorSpec | tuple] | None = None
) -> tuple[dict[str, StoredTensor], Mapping[str, TensorSpec]]:
    """Headers of every shard, validated against the inventory; no tensor data is read."""
    stored = read_checkpoint_index(directory)
    if inventory is None:
        expected = official_inventory(config, include_unused=True)
    else:
        expected = as_specs(inventory)
    validate_checkpoint(stored, expected, where=str(directory))
    return stored, expected


def load_into(
    module: nn.Module,
    path: str | os.PathLike[str] | None = None,
    *,
    config: ModelConfig | None = None,
    inventory: Mapping[str, TensorSpec | tuple] | None = None,
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> LoadReport:
    """Fill ``module``'s parameters (official names) from the checkpoint at ``path``.

    ``config`` defaults to the module's ``config`` attribute, else the checkpoint's
    ``config.json``. ``load_format="dummy"`` fills random weights and reads no file.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {LOAD_FORMATS}")
    if load_format == "dummy":
        fill_dummy(module, seed=seed)
        return LoadReport(directory=None, loaded=len(module.state_dict()))
    directory = resolve_model_path(path)
    config = config or getattr(module, "config", None) or load_config(directory)
    stored, expected = read_and_validate(directory, config, inventory)
    targets = dict(module.state_dict())
    plan, report = _plan(stored, expected, targets, directory, held_elsewhere(module))
    _stream(plan, stored, targets, config, progress)
    report.loaded = len(plan)
    return report


def fill_tensors(
    targets: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str] | None,
    *,
    config: ModelConfig,
    load_format: str = "auto",
    seed: int = 0,
) -> None:
    """Fill just ``targets`` (official names): the tensors a :func:`load_into` of the whole
    module left on the meta device and that were then placed elsewhere (the checkpoint was
    validated by that call). Dummy values come from their own generator, seeded ``seed``.
    A tensor stored as it is kept is copied in slices of about ``FILL_SLICE_BYTES``, so a
    ~98 GB table never has a second, private copy in this process."""
    if load_format == "dummy":
        fill_dummy(targets, seed=seed)
        return
    stored = read_checkpoint_index(resolve_model_path(path))
    for name, target in targets.items():
        entry = stored[name]
        dequantised = target.dtype in FLOAT_FAMILY and entry.dtype not in FLOAT_FAMILY
        if dequantised or entry.expert_slice is not None or target.dim() == 0:
            _stream([name], stored, targets, config, progress=False)
        else:
            _fill_in_slices(name, target, stored, config)


def _fill_in_slices(name: str, target: torch.Tensor, stored, config: ModelConfig) -> None:
    """Copy a tensor stored as it is kept, ``FILL_SLICE_BYTES`` of rows at a time."""
    entry = stored[name]
    rows = max(1, FILL_SLICE_BYTES // max(1, target[0].numel() * entry.dtype.itemsize))
    with safe_open(entry.file, framework="pt") as f, torch.no_grad():
        stored_rows = f.get_slice(entry.key)
        for start in range(0, target.shape[0], rows):
            part = stored_rows[start : start + rows]
            _assign(name, target[start : start + rows], part, stored, config)


def _plan(
    stored: Mapping[str, StoredTensor],
    expected: Mapping[str, TensorSpec],
    targets: Mapping[str, torch.Tensor],
    directory: Path,
    elsewhere: Callable[[str], bool] | None = None,
) -> tuple[list[str], LoadReport]:
    """Which stored tensors go into the module; errors for tensors that have nowhere to go.
    ``elsewhere(name)``: the tensor is a routed expert another EP rank holds (never read)."""
    report = LoadReport(directory)
    skipped: dict[str, list[str]] = defaultdict(list)
    absent_groups = [p for p in OPTIONAL_PREFIXES if not any(t.startswith(p) for t in targets)]
    plan, homeless = [], []
    for name in stored:
        if expected[name].unused:
            skipped[expected[name].unused].append(name)
        elif expected[name].skip and name not in targets:
            skipped["vision (a model built without its tower)"].append(name)
        elif name in targets and targets[name].is_meta:
            skipped["placed after the model (tables in node shared memory)"].append(name)
        elif name in targets:
            plan.append(name)
        elif name.endswith(".scale") and _dequantised_on_load(name, stored, targets):
            continue  # consumed with its weight
        elif any(name.startswith(p) for p in absent_groups):
            skipped["not built into the module"].append(name)
        elif elsewhere is not None and elsewhere(name):
            skipped["routed experts held by other EP ranks"].append(name)
        else:
            homeless.append(name)
    unfilled = sorted(n for n in targets if n not in stored)
    if homeless or unfilled:
        raise CheckpointError(
            f"checkpoint {directory} and the module disagree: "
            f"{len(homeless)} checkpoint tensors have no parameter ({homeless[:10]}), "
            f"{len(unfilled)} parameters are not in the checkpoint ({unfilled[:10]})"
        )
    for reason, names in skipped.items():
        logger.info("checkpoint %s: skipped %d tensors (%s)", directory, len(names), reason)
    report.skipped = dict(skipped)
    return plan, report


def _dequantised_on_load(scale_name, stored, targets) -> bool:
    weight = scale_name.removesuffix(".scale") + ".weight"
    return weight in targets and weight in stored and targets[weight].dtype in FLOAT_FAMILY


def _stream(plan, stored, targets, config: ModelConfig, progress: bool) -> None:
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in plan:
        by_file[stored[name].file].append(name)
    bar = tqdm(total=len(plan), desc="Loading weights", unit="tensor", disable=not progress)
    with bar, torch.no_grad():
        for file in sorted(by_file):
            with safe_open(file, framework="pt") as f:
                for name in by_file[file]:
                    tensor = _read(f, stored[name])
                    _assign(name, targets[name], tensor, stored, config)
                    bar.update(1)


def _read(f, entry: StoredTensor) -> torch.Tensor:
    if entry.expert_slice is None:
        return f.get_tensor(entry.key)
    part = entry.expert_slice
    return f.get_slice(entry.key)[part.expert, part.row_start : part.row_end]


def _read_tensor(entry: StoredTensor) -> torch.Tensor:
    with safe_open(entry.file, framework="pt") as f:
        return _read(f, entry)


def read_tensors(
    path: str | os.PathLike[str], names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The stored tensors (official names, stored dtypes) of a checkpoint, unvalidated.

    For tests and tools; models load with :func:`load_into`.
    """
    stored = read_checkpoint_index(resolve_model_path(path))
    wanted = sorted(stored) if names is None else names
    return {name: _read_tensor(stored[name]) for name in wanted}


def _assign(name, target: torch.Tensor, tensor: torch.Tensor, stored, config) -> None:
    if target.dtype in FLOAT_FAMILY and tensor.dtype in (torch.float8_e4m3fn, torch.int8):
        tensor = _dequantise(name, tensor, stored, config)
    elif target.dtype == torch.uint8 and tensor.dtype == torch.float8_e8m0fnu:
        tensor = tensor.view(torch.uint8)
    elif target.dtype == torch.float8_e8m0fnu and tensor.dtype == torch.uint8:
        tensor = tensor.view(torch.float8_e8m0fnu)  # scales some writers store as U8
    elif target.dtype == torch.int8 and tensor.dtype == torch.uint8:
        tensor = tensor.view(torch.int8)  # packed e2m1 bytes stored unsigned
    same_kind = target.dtype == tensor.dtype or any(
        target.dtype in family and tensor.dtype in family
        for family in (FLOAT_FAMILY, _INDEX_FAMILY)
    )
    if not same_kind or tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"tensor {name!r}: stored {list(tensor.shape)} {dtype_name(tensor.dtype)} cannot "
            f"fill parameter {list(target.shape)} {dtype_name(target.dtype)}"
        )
    target.copy_(tensor)


def _dequantise(name: str, tensor: torch.Tensor, stored, config: ModelConfig) -> torch.Tensor:
    scale_name = name.removesuffix(".weight") + ".scale"
    if scale_name not in stored:
        raise CheckpointError(f"tensor {name!r} is quantised but {scale_name!r} is not stored")
    scale = _read_tensor(stored[scale_name])
    if tensor.dtype == torch.int8:
        return K.fp4_dequant(tensor, scale, 32, out_dtype=torch.float32)
    if name.endswith("engram.embed.weight"):
        block = (1, ENGRAM_SCALE_BLOCK)
    else:
        block = config.weight_block or (128, 128)
    return K.fp8_block_dequant(tensor, scale, block, out_dtype=torch.float32)
