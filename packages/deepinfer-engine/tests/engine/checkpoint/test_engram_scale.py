"""A float V4.1 checkpoint in the form transformers' ``deepseek_v41`` port saves it: an
``engram.embed.scale`` next to every unquantised Engram table. The port's table reads its scale
only when the table is FP8, so a float checkpoint's scale changes nothing: the checkpoint loads
(through the loader and ``LLM``) and runs exactly like the same weights without the scales,
even when the scales are not ones, while the same scales folded into the table do change the
output (the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.engine.checkpoint import (
    CheckpointMismatchError,
    load_into,
    load_model,
    official_inventory,
    read_checkpoint_index,
)
from deepinfer.engine.checkpoint.inventory_layers import FLOAT_ENGRAM_SCALE
from deepinfer.engine.checkpoint.names import official_name
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing import (
    random_state_dict,
    tiny_v41_config,
    with_quantization,
    write_checkpoint,
)
from deepinfer.engine.testing.random_checkpoint import write_testing_tokenizer
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.sampling import SamplingParams

RAW = with_quantization(tiny_v41_config(vision=False), False)
CONFIG = parse_config(RAW)
TABLES = [f"layers.{i}.engram.embed" for i in CONFIG.engram_layer_ids]
PROMPT = [5, 40, 41, 40, 41, 40, 200, 201, 40, 41, 33, 17, 40, 41, 90, 91, 92, 40, 41, 7]


def _scales(seed: int) -> dict[str, torch.Tensor]:
    """Powers of two from 1/4 to 4, never all ones: what a port's float save may hold."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for table in TABLES:
        shape = official_inventory(CONFIG, include_unused=True)[f"{table}.scale"].shape
        out[f"{table}.scale"] = 2.0 ** torch.randint(-2, 3, shape, generator=g).float()
    return out


def _write(directory, tensors, *, unused: bool):
    write_checkpoint(directory, RAW, tensors, float_dtype=torch.float32, unused=unused)
    write_testing_tokenizer(directory, CONFIG.vocab_size)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(plain: no scales, port: scales stored, folded: table multiplied by the scales)."""
    weights = random_state_dict(CONFIG, seed=3, include_vision=False)
    scales = _scales(4)
    plain = _write(tmp_path_factory.mktemp("plain"), weights, unused=False)
    port = _write(tmp_path_factory.mktemp("port"), {**weights, **scales}, unused=True)
    folded = dict(weights)
    for table in TABLES:
        per_column = scales[f"{table}.scale"].repeat_interleave(32, dim=-1)
        folded[f"{table}.weight"] = weights[f"{table}.weight"] * per_column
    folded_dir = _write(tmp_path_factory.mktemp("folded"), folded, unused=False)
    return plain, port, folded_dir


def _logits(directory) -> torch.Tensor:
    model = load_model(directory, dtype=torch.float32, progress=False)
    runner = SimpleRunner(model, max_seqs=1, max_len=len(PROMPT) + 1)
    return runner.step({0: PROMPT})[0]


def test_the_port_form_stores_the_scales_and_loads_skipping_them(checkpoints):
    plain, port, _ = checkpoints
    stored = read_checkpoint_index(port)
    assert set(stored) - set(read_checkpoint_index(plain)) == {f"{t}.scale" for t in TABLES}
    assert all(stored[f"{t}.scale"].dtype == torch.float32 for t in TABLES)
    model = load_model(plain, dtype=torch.float32, progress=False)
    report = load_into(model, port, progress=False)
    assert sorted(report.skipped[FLOAT_ENGRAM_SCALE]) == sorted(f"{t}.scale" for t in TABLES)
    assert not any(name.endswith("embed.scale") for name in model.state_dict())
    # the port's save_pretrained spelling of the same tensor
    assert official_name(f"model.{TABLES[0]}.scale") == f"{TABLES[0]}.scale"


def test_float_scales_are_ignored_as_in_the_port(checkpoints):
    plain, port, folded = checkpoints
    reference, with_scales = _logits(plain), _logits(port)
    assert torch.equal(with_scales, reference)
    # the scales would matter if they were applied: folded in, the logits move
    assert (_logits(folded) - reference).abs().max() > 1e-3


def test_llm_runs_the_port_form_like_the_plain_checkpoint(checkpoints):
    plain, port, folded = checkpoints
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outputs = []
    for directory in (plain, port, folded):
        llm = LLM(str(directory), dtype="float32", block_size=16, max_model_len=64)
        (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
        outputs.append(out)
    reference, with_scales, with_folded = outputs
    assert with_scales.outputs[0].token_ids == reference.outputs[0].token_ids
    assert with_scales.prompt_logprobs == reference.prompt_logprobs
    assert with_folded.prompt_logprobs != reference.prompt_logprobs


def test_a_misshaped_scale_is_named_before_loading(checkpoints, tmp_path):
    _, port, _ = checkpoints
    name = f"{TABLES[0]}.scale"
    for file in port.iterdir():
        target = tmp_path / file.name
        if file.suffix != ".safetensors":
            target.write_bytes(file.read_bytes())
            continue
        with safe_open(file, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        if name in tensors:
            tensors[name] = torch.ones(tensors[name].shape[0], 2)
        save_file(tensors, str(target), metadata={"format": "pt"})
    expected = list(official_inventory(CONFIG, include_unused=True)[name].shape)
    with pytest.raises(CheckpointMismatchError) as info:
        load_model(tmp_path, dtype=torch.float32, progress=False)
    assert info.value.mismatch.misshaped == (name,)
    assert f"{name}: found [{expected[0]}, 2] F32" in str(info.value)
    assert f"expected {expected}" in str(info.value)


def test_the_default_inventory_and_writer_are_unchanged():
    assert not any(s.unused for s in official_inventory(CONFIG).values())
    quantised = parse_config(with_quantization(tiny_v41_config(vision=False), True))
    with_unused = official_inventory(quantised, include_unused=True)
    assert with_unused == official_inventory(quantised)  # FP8 tables' scales are real
