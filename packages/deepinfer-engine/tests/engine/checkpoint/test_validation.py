"""A bad checkpoint fails before any weight is read, naming everything wrong with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deepinfer.engine.checkpoint.loader as loader_module
from deepinfer.engine.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_into,
    official_inventory,
    read_checkpoint_index,
    read_safetensors_header,
    shard_files,
    validate_checkpoint,
)
from deepinfer.engine.model.config import QuantConfig
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.testing import make_random_checkpoint, module_with_tensors, tiny_v4_config

MISSING = "layers.1.attn.wq_a.weight"
EXTRA = "layers.1.attn.bogus.weight"
MISSHAPED = "layers.2.attn.kv_norm.weight"
WRONG_DTYPE = "layers.1.attn.wkv.weight"  # FP8 expected, BF16 stored


def _rewrite_shards(directory: Path, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to every stored tensor; rewrite shards and index."""
    files = shard_files(directory)
    owner, tensors = {}, {}
    for f in files:
        for k, v in load_file(f).items():
            owner[k], tensors[k] = f, v
    tensors = edit(tensors)
    for f in files:
        shard = {k: v for k, v in tensors.items() if owner.get(k, files[0]) == f}
        save_file(shard, str(f), metadata={"format": "pt"})
    index = {"weight_map": {k: owner.get(k, files[0]).name for k in tensors}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _break(tensors):
    del tensors[MISSING]
    tensors[EXTRA] = torch.randn(4, 4)
    tensors[MISSHAPED] = torch.randn(3).bfloat16()
    tensors[WRONG_DTYPE] = tensors[WRONG_DTYPE].float().bfloat16()
    return tensors


def _truncate_data(directory: Path) -> None:
    """Cut every shard right after its header: reading any tensor would now fail."""
    for f in shard_files(directory):
        raw = f.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[: 8 + length])


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("broken")
    make_random_checkpoint(
        directory,
        tiny_v4_config(),
        quantized=True,
        seed=1,
        tokenizer=False,
        max_shard_bytes=100_000,
    )
    assert len(shard_files(directory)) > 1
    _rewrite_shards(directory, _break)
    _truncate_data(directory)
    return directory


def test_four_kinds_of_mismatch_fail_before_any_data_is_read(broken_checkpoint, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("tensor data was read before validation finished")

    monkeypatch.setattr(loader_module, "safe_open", no_reading)
    config = load_config(broken_checkpoint)
    inventory = official_inventory(config)
    module = module_with_tensors({n: (s.shape, s.dtype) for n, s in inventory.items()})
    with pytest.raises(CheckpointMismatchError) as info:
        load_into(module, broken_checkpoint, progress=False)
    message = str(info.value)
    for name in (MISSING, EXTRA, MISSHAPED, WRONG_DTYPE):
        assert name in message
    assert "1 missing, 1 unexpected, 1 mis-shaped, 1 with the wrong dtype" in message
    assert "found BF16, expected F8_E4M3" in message
    assert "found [3] BF16" in message and "expected [96]" in message
    mismatch = info.value.mismatch
    assert mismatch.missing == (MISSING,)
    assert mismatch.unexpected == (EXTRA,)
    assert mismatch.misshaped == (MISSHAPED,)
    assert mismatch.wrong_dtype == (WRONG_DTYPE,)


def test_headers_are_read_without_the_data(broken_checkpoint):
    # the data was truncated away, yet every header (and the whole index) still reads
    stored = read_checkpoint_index(broken_checkpoint)
    assert stored[MISSHAPED].shape == (3,)
    assert stored[WRONG_DTYPE].dtype == torch.bfloat16
    first = shard_files(broken_checkpoint)[0]
    assert all("data_offsets" in v for v in read_safetensors_header(first).values())


def test_listing_is_capped_but_counts_everything(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=False, seed=0, tokenizer=False)
    config = load_config(tmp_path)
    stored = read_checkpoint_index(tmp_path)
    validate_checkpoint(stored, official_inventory(config))  # matches its own config
    # expecting a quantised checkpoint: every scale is missing, every FP8 weight wrong dtype
    fp8 = official_inventory(config.with_overrides(quantization=QuantConfig((128, 128))))
    with pytest.raises(CheckpointMismatchError) as info:
        validate_checkpoint(stored, fp8, where="x")
    n_scales = sum(n.endswith(".scale") for n in fp8)
    assert f"{n_scales} missing, 0 unexpected, 0 mis-shaped, {n_scales} with the wrong" in str(
        info.value
    )
    assert "... and" in str(info.value)


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
    make_random_checkpoint(
        tmp_path,
        tiny_v4_config(),
        quantized=False,
        seed=0,
        tokenizer=False,
        max_shard_bytes=100_000,
    )
    shard_files(tmp_path)[-1].unlink()
    with pytest.raises(CheckpointError, match="shards that do not exist"):
        read_checkpoint_index(tmp_path)


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
    )
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        read_checkpoint_index(tmp_path)


def test_index_disagreeing_with_the_headers_is_an_error(tmp_path):
    make_random_checkpoint(
        tmp_path,
        tiny_v4_config(),
        quantized=False,
        seed=0,
        tokenizer=False,
        max_shard_bytes=100_000,
    )
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][key] = files[1]
    index["weight_map"]["layers.9.ghost.weight"] = files[0]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"2 keys not in the shard it names"):
        read_checkpoint_index(tmp_path)


def test_command_line_validation(tmp_path, broken_checkpoint, capsys):
    from deepinfer.engine.checkpoint.__main__ import main

    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=0, tokenizer=False)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DeepseekV4ForCausalLM, 4 layers" in out and "F8_E4M3" in out and "ok: " in out
    assert main([str(broken_checkpoint)]) == 1
    assert MISSING in capsys.readouterr().out


def test_plain_shape_dtype_inventories_are_accepted(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=0, tokenizer=False)
    config = load_config(tmp_path)
    pairs = {n: (s.shape, s.dtype) for n, s in official_inventory(config).items()}
    stored = read_checkpoint_index(tmp_path)
    validate_checkpoint(stored, pairs)
    pairs["layers.1.attn.wkv.weight"] = ((96, 128), torch.bfloat16)
    with pytest.raises(CheckpointMismatchError, match="0 mis-shaped, 1 with the wrong dtype"):
        validate_checkpoint(stored, pairs)
