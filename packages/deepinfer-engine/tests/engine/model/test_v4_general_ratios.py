"""V4 with a general HCA compression ratio (8): transformers' config form parses to it, the whole
engine is exact with it (incremental decode and chunked prefill give the full forward's greedy
tokens), and ratios that cannot work are refused with one line naming the limitation."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.checkpoint.model_loader import load_model
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.config import ConfigError
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.sampling import SamplingParams

BLOCK = 16  # a multiple of both ratios (4, 8)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = ["sliding_attention", CSA, HCA, CSA]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v4-hca8")
    make_random_checkpoint(directory, tiny_v4_config(hca_ratio=8), quantized=False, seed=0)
    return directory


def _transformers_form(**rates) -> dict:
    raw = tiny_v4_config()
    raw.pop("compress_ratios")
    return {**raw, "layer_types": LAYER_TYPES, "compress_rates": rates}


def test_transformers_rates_parse_to_per_layer_ratios():
    c = parse_config(_transformers_form(**{CSA: 4, HCA: 8}))
    assert c.compress_ratios == (0, 4, 8, 4)
    assert [c.layer_kind(i) for i in range(4)] == ["swa", "csa", "hca", "csa"]
    assert c.index_source_of(2) is None and c.index_source_of(1) == 1


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    lengths = [rng.randrange(3, 40) for _ in range(10)] + [BLOCK * 3 - 1, BLOCK * 4 + 7]
    return [[rng.randrange(20, 250) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts, max_tokens: int = 12):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _full_forward_argmax(directory, prompts, outputs) -> list[list[int]]:
    """The greedy choice at each generating position of one whole-sequence forward."""
    model = load_model(directory, device="cpu", dtype=torch.float32, progress=False)
    choices = []
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = prompt + output
        logits = SimpleRunner(model, max_seqs=1, max_len=len(tokens)).step({0: tokens})[0]
        choices.append(logits[len(prompt) - 1 : len(tokens) - 1].argmax(-1).tolist())
    return choices


def test_decode_and_chunked_prefill_equal_the_full_forward(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    prompts = _prompts()
    llm = LLM(str(checkpoint), dtype="float32", block_size=BLOCK, max_model_len=128)
    together = _greedy(llm, prompts)
    # 12 decode steps cross several ratio-8 entries: each decoded token equals the argmax of
    # one full prefill over prompt + output
    assert _full_forward_argmax(checkpoint, prompts, together) == together
    chunked = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=128,
        max_num_batched_tokens=7,  # prompts split mid-entry of both ratios
    )
    assert _greedy(chunked, prompts) == together


@pytest.mark.parametrize(
    ("rates", "field"),
    [
        ({CSA: 8, HCA: 128}, f"compress_rates['{CSA}']"),  # CSA told apart by ratio 4
        ({CSA: 4, HCA: 4}, f"compress_rates['{HCA}']"),  # would read as CSA
        ({CSA: 4, HCA: 0}, f"compress_rates['{HCA}']"),  # no window
    ],
)
def test_rates_that_blur_the_layer_kinds_are_refused(rates, field):
    with pytest.raises(ConfigError) as err:
        parse_config(_transformers_form(**rates))
    message = str(err.value)
    assert message.startswith(f"config field {field!r}") and "\n" not in message


def test_negative_ratio_is_refused():
    with pytest.raises(ConfigError, match="'compress_ratios' = \\[-8\\]: expected ratios >= 0"):
        parse_config(tiny_v4_config(hca_ratio=-8))


def test_block_size_not_holding_whole_entries_is_refused(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(hca_ratio=12), quantized=False, seed=0)
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), dtype="float32", block_size=BLOCK, max_model_len=128)
    message = str(err.value)
    assert "block_size 16 is not a multiple of layer 2's compression ratio 12" in message
    assert "\n" not in message
    # the same ratio works with a block size it divides
    llm = LLM(str(tmp_path), dtype="float32", block_size=48, max_model_len=128)
    assert len(_greedy(llm, [[30, 31, 32]], max_tokens=2)[0]) == 2
