"""Loading: writer -> loader round trips, dequantise-on-load, skipped groups, dummy weights."""

from __future__ import annotations

import time

import pytest
import torch

import deepinfer.kernels as K
from deepinfer.engine.checkpoint import CheckpointError, load_into, official_inventory
from deepinfer.engine.model.config_parsing import load_config, parse_config
from deepinfer.engine.testing import (
    make_random_checkpoint,
    module_with_tensors,
    random_state_dict,
    tiny_v4_config,
    tiny_v41_config,
    with_quantization,
)


def _module_for(config, *, include_mtp=True, overrides=None):
    inventory = official_inventory(config, include_mtp=include_mtp, include_vision=False)
    specs = {n: (s.shape, s.dtype) for n, s in inventory.items()}
    specs.update(overrides or {})
    return module_with_tensors(specs)


@pytest.mark.parametrize("raw", [tiny_v4_config(), tiny_v41_config()], ids=["v4", "v41"])
def test_unquantised_fp32_round_trip_is_exact(tmp_path, raw):
    make_random_checkpoint(
        tmp_path, raw, quantized=False, seed=5, float_dtype=torch.float32, tokenizer=False
    )
    config = load_config(tmp_path)
    module = _module_for(config)
    for t in module.state_dict().values():
        t.zero_() if not t.is_floating_point() else t.fill_(float("nan"))
    report = load_into(module, tmp_path, progress=False)
    values = random_state_dict(config, seed=5)
    state = module.state_dict()
    assert report.loaded == len(state)
    for name, t in state.items():
        expected = values[name].to(t.dtype)
        assert torch.equal(t, expected), name
    skipped = sum(report.skipped.values(), [])
    assert all(n.startswith(("vision.", "aligner.", "image_")) for n in skipped)
    assert len(skipped) == (18 if config.is_v41 else 0)  # a module built without the tower


@pytest.mark.parametrize("raw", [tiny_v4_config(), tiny_v41_config()], ids=["v4", "v41"])
def test_quantised_round_trip_stores_the_official_formats(tmp_path, raw):
    make_random_checkpoint(tmp_path, raw, quantized=True, seed=6, tokenizer=False)
    config = load_config(tmp_path)
    module = _module_for(config)
    load_into(module, tmp_path, progress=False)
    values = random_state_dict(config, seed=6)
    state = module.state_dict()
    block = config.weight_block
    checked = {"fp8": 0, "fp4": 0, "engram": 0, "float": 0}
    for name, t in state.items():
        if name.endswith(".scale"):
            continue
        base = name.removesuffix(".weight")
        if t.dtype == torch.float8_e4m3fn:
            is_table = name.endswith("engram.embed.weight")
            codes, scale = K.fp8_block_quant(values[name], (1, 32) if is_table else block)
            checked["engram" if is_table else "fp8"] += 1
        elif t.dtype == torch.int8:
            codes, scale = K.fp4_quant(values[name], 32)
            checked["fp4"] += 1
        else:
            assert torch.equal(t, values[name].to(t.dtype)), name
            checked["float"] += 1
            continue
        assert torch.equal(t.view(torch.uint8), codes.view(torch.uint8)), name
        assert torch.equal(state[f"{base}.scale"].view(torch.uint8), scale.view(torch.uint8))
    assert checked["fp8"] and checked["fp4"] and checked["float"]
    assert bool(checked["engram"]) == config.is_v41


def test_quantised_weights_dequantise_into_float_parameters(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=7, tokenizer=False)
    config = load_config(tmp_path)
    fp8_name, fp4_name = "layers.1.attn.wo_a.weight", "layers.2.ffn.experts.3.w2.weight"
    overrides = {fp8_name: ((128, 192), torch.float32), fp4_name: ((128, 128), torch.bfloat16)}
    module = _module_for(config, overrides=overrides)
    for name in (fp8_name, fp4_name):  # the float copy replaces weight + scale
        *path, _ = name.split(".")
        delattr(module.get_submodule(".".join(path)), "scale")
    load_into(module, tmp_path, progress=False)
    values = random_state_dict(config, seed=7)
    codes, scale = K.fp8_block_quant(values[fp8_name], (128, 128))
    want = K.fp8_block_dequant(codes, scale, (128, 128), out_dtype=torch.float32)
    assert torch.equal(module.state_dict()[fp8_name], want)
    assert (want - values[fp8_name]).abs().max() < values[fp8_name].abs().max() / 8
    packed, scale = K.fp4_quant(values[fp4_name], 32)
    want = K.fp4_dequant(packed, scale, 32, out_dtype=torch.bfloat16)
    assert torch.equal(module.state_dict()[fp4_name], want)


def test_module_without_mtp_skips_the_stages_but_not_other_tensors(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=False, seed=8, tokenizer=False)
    config = load_config(tmp_path)
    report = load_into(_module_for(config, include_mtp=False), tmp_path, progress=False)
    skipped = report.skipped["not built into the module"]
    assert skipped and all(n.startswith("mtp.0.") for n in skipped)
    lacking = _module_for(config, include_mtp=False)
    delattr(lacking.layers.get_submodule("1").attn, "wkv")
    with pytest.raises(CheckpointError, match=r"1 checkpoint tensors have no parameter"):
        load_into(lacking, tmp_path, progress=False)
    extra = _module_for(config, overrides={"layers.0.attn.extra": ((2,), torch.float32)})
    with pytest.raises(CheckpointError, match=r"1 parameters are not in the checkpoint"):
        load_into(extra, tmp_path, progress=False)


def test_dummy_load_reads_nothing_and_gives_usable_values():
    raw = tiny_v4_config(hidden_size=512, moe_intermediate_size=256, n_routed_experts=8)
    config = parse_config(with_quantization(raw, True))
    module = _module_for(config)
    for t in module.state_dict().values():
        if t.dtype in (torch.float32, torch.bfloat16):
            t.fill_(float("nan"))
    start = time.perf_counter()
    report = load_into(module, "/nonexistent", load_format="dummy", seed=3)
    elapsed = time.perf_counter() - start
    assert report.directory is None and elapsed < 20.0  # ~1 s; generous for a loaded CI box
    state = module.state_dict()
    for name, t in state.items():
        if t.dtype == torch.float8_e8m0fnu:
            assert (t.view(torch.uint8) < 255).all() and (t.view(torch.uint8) > 100).all(), name
        elif t.is_floating_point():
            assert torch.isfinite(t.float()).all(), name
    tid2eid = state["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < 8
    assert all(len(set(row)) == 2 for row in tid2eid.tolist())
    assert torch.equal(state["layers.1.attn.kv_norm.weight"], torch.ones(96, dtype=torch.bfloat16))
    # a dequantised linear has roughly unit-variance outputs for unit-variance inputs
    for name, fmt in (("layers.1.attn.wq_a", "fp8"), ("layers.1.ffn.experts.0.w1", "fp4")):
        w, s = state[f"{name}.weight"], state[f"{name}.scale"]
        if fmt == "fp8":
            dense = K.fp8_block_dequant(w, s, (128, 128), out_dtype=torch.float32)
        else:
            dense = K.fp4_dequant(w, s, 32, out_dtype=torch.float32)
        gain = (dense @ torch.randn(dense.shape[1], 64)).std().item()
        assert 0.3 < gain < 3.0, (name, gain)
    again = _module_for(config)
    load_into(again, None, load_format="dummy", seed=3)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(state.values(), again.state_dict().values())
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    )


def test_unknown_load_format(tmp_path):
    with pytest.raises(ValueError, match="load_format='pt'"):
        load_into(module_with_tensors({}), tmp_path, load_format="pt")


def test_unsigned_byte_spellings_of_scales_and_packed_fp4_load(tmp_path):
    from safetensors.torch import load_file, save_file

    from deepinfer.engine.checkpoint import shard_files

    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=3, tokenizer=False)
    config = load_config(tmp_path)
    reference = _module_for(config)
    load_into(reference, tmp_path, progress=False)
    for f in shard_files(tmp_path):  # rewrite every e8m0 and int8 tensor as uint8
        tensors = {
            k: v.view(torch.uint8) if v.dtype in (torch.float8_e8m0fnu, torch.int8) else v
            for k, v in load_file(f).items()
        }
        save_file(tensors, str(f), metadata={"format": "pt"})
    again = _module_for(config)
    load_into(again, tmp_path, progress=False)
    for (name, a), b in zip(reference.state_dict().items(), again.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_tensors_stream_one_shard_at_a_time(tmp_path, monkeypatch):
    import deepinfer.engine.checkpoint.loader as loader_module
    from deepinfer.engine.checkpoint import shard_files

    make_random_checkpoint(
        tmp_path,
        tiny_v4_config(),
        quantized=True,
        seed=2,
        tokenizer=False,
        max_shard_bytes=60_000,
    )
    real_open, events = loader_module.safe_open, []

    class Recording:
        def __init__(self, path, framework):
            self.path, self.inner = path, real_open(path, framework=framework)

        def __enter__(self):
            events.append(("open", self.path.name))
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            events.append(("close", self.path.name))
            return self.inner.__exit__(*exc)

        def get_tensor(self, key):
            events.append(("read", self.path.name))
            return self.file.get_tensor(key)

    monkeypatch.setattr(loader_module, "safe_open", Recording)
    load_into(_module_for(load_config(tmp_path)), tmp_path, progress=False)
    files = [f.name for f in shard_files(tmp_path)]
    opened = [name for kind, name in events if kind == "open"]
    assert opened == files  # each shard opened once, in order
    current = None
    for kind, name in events:  # every read happens while its own shard is the open one
        if kind == "open":
            current = name
        elif kind == "read":
            assert name == current
        else:
            current = None
