"""The checkpoint writer: official on-disk layout, formats, config files and tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deepinfer.engine.checkpoint import read_safetensors_header, shard_files
from deepinfer.engine.model.config_parsing import load_config, parse_config
from deepinfer.engine.testing import (
    make_random_checkpoint,
    random_state_dict,
    tiny_v4_config,
    tiny_v41_config,
    with_quantization,
    write_checkpoint,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _raw(directory, name):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    with safe_open(directory / index["weight_map"][name], framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def v4_quantized(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v4q")
    make_random_checkpoint(
        directory, tiny_v4_config(), quantized=True, seed=11, max_shard_bytes=150_000
    )
    return directory


def test_shards_and_index_agree(v4_quantized):
    index = json.loads((v4_quantized / "model.safetensors.index.json").read_text())
    files = shard_files(v4_quantized)
    assert len(files) > 1
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    seen, total = {}, 0
    for f in files:
        for key, info in read_safetensors_header(f).items():
            seen[key] = f.name
            start, end = info["data_offsets"]
            total += end - start
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_config_files_carry_the_quantisation(v4_quantized, tmp_path):
    config = json.loads((v4_quantized / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert config["expert_dtype"] == "fp4"
    generation = json.loads((v4_quantized / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    v41 = with_quantization(tiny_v41_config(), True)
    assert v41["quantization_config"]["weight_block_size"] == [32, 32]
    assert v41["quantization_config"]["expert_dtype"] == "fp4"
    assert "quantization_config" not in with_quantization(v41, False)
    assert "expert_dtype" not in with_quantization(tiny_v4_config(expert_dtype="fp4"), False)
    assert parse_config(v41).quantization.weight_block_size == (32, 32)


def test_fp4_experts_are_packed_low_nibble_first(v4_quantized):
    config = load_config(v4_quantized)
    values = random_state_dict(config, seed=11)
    name = "layers.2.ffn.experts.1.w3.weight"
    packed = _raw(v4_quantized, name).view(torch.uint8)
    scale = _raw(v4_quantized, name.replace(".weight", ".scale")).view(torch.uint8)
    assert packed.shape == (128, 64) and scale.shape == (128, 4)
    row = 5
    decoded = []
    for byte in packed[row].tolist():
        for nibble in (byte & 0xF, byte >> 4):  # column 2k, then 2k + 1
            sign = -1.0 if nibble & 8 else 1.0
            decoded.append(sign * E2M1[nibble & 7])
    scales = [2.0 ** (int(s) - 127) for s in scale[row].tolist()]
    dequant = torch.tensor([v * scales[c // 32] for c, v in enumerate(decoded)])
    original = values[name][row]
    assert torch.allclose(dequant, original, atol=float(max(scales)))  # within one e2m1 step
    assert torch.corrcoef(torch.stack([dequant, original]))[0, 1] > 0.95


def test_fp8_weights_dequantise_close_to_the_input(v4_quantized):
    config = load_config(v4_quantized)
    values = random_state_dict(config, seed=11)
    name = "layers.1.attn.wq_b.weight"
    codes = _raw(v4_quantized, name)
    scale = _raw(v4_quantized, name.replace(".weight", ".scale"))
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (3, 1)  # [384, 128] in 128 x 128 blocks
    dense = codes.float() * scale.float().repeat_interleave(128, 0)[:, :128]
    err = (dense - values[name]).abs()
    assert (err <= values[name].abs() / 16 + scale.float().max() / 512).all()
    assert _raw(v4_quantized, "layers.1.attn.compressor.wkv.weight").dtype == torch.bfloat16
    assert _raw(v4_quantized, "layers.1.attn.attn_sink").dtype == torch.float32
    assert _raw(v4_quantized, "layers.0.ffn.gate.tid2eid").dtype == torch.int64


def test_v41_engram_table_has_per_row_scales(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v41_config(), quantized=True, seed=2, tokenizer=False)
    config = load_config(tmp_path)
    values = random_state_dict(config, seed=2)
    table = _raw(tmp_path, "layers.4.engram.embed.weight")
    scale = _raw(tmp_path, "layers.4.engram.embed.scale")
    rows = config.engram_num_embeddings[1]
    assert table.shape == (rows, 32) and scale.shape == (rows, 1)
    dense = table.float() * scale.float()
    original = values["layers.4.engram.embed.weight"]
    row_max = original.abs().amax(1, keepdim=True)
    assert ((dense - original).abs() <= row_max / 16).all()
    assert _raw(tmp_path, "layers.1.engram.wkv.scale").shape == (64 * 3 // 32, 128 // 32)


def test_tokenizer_is_written_with_the_special_tokens(v4_quantized):
    from deepinfer.engine.tokenizer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(v4_quantized)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.vocab_size <= load_config(v4_quantized).vocab_size
    text = "def add(a, b): return a + b"
    assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text


def test_same_seed_same_bytes(tmp_path):
    for d in ("a", "b"):
        make_random_checkpoint(
            tmp_path / d, tiny_v4_config(), quantized=True, seed=4, tokenizer=False
        )
    for f in shard_files(tmp_path / "a"):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()


def test_writer_rejects_tensors_that_do_not_fit_the_config(tmp_path):
    raw = with_quantization(tiny_v4_config(), False)
    values = random_state_dict(parse_config(raw), seed=0)
    del values["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        write_checkpoint(tmp_path, raw, values)
    values = random_state_dict(parse_config(raw), seed=0)
    values["layers.1.attn.wkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'layers.1.attn.wkv.weight' has shape \[3, 3\]"):
        write_checkpoint(tmp_path, raw, values)
