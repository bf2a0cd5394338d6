"""YoCo prefill truncation through ``LLM`` on the embedded model (``examples/tiny_model``:
window 128, consumer layers 5-7, DSpark taps 5-7), batch invariant: ``compact`` equals ``mask``
bit for bit (tokens and every sampled token's logprob, greedy and seeded sampling) for a prompt
longer than the keep, whole or chunked, with and without speculation; a keep of the whole
prompt equals ``off``; bad settings fail at start-up in one line and a prompt-logprob request
fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.tokenizer import load_tokenizer

CHECKPOINT = Path(__file__).resolve().parents[5] / "examples" / "tiny_model" / "checkpoint"
# a Python-shaped prompt of ~150 tokens (> the keep of 128 + drafts) and a short one
LONG = '''import os
import sys


def walk(root, pattern=None):
    """Yield every file below root whose name matches pattern."""
    for directory, subdirs, files in os.walk(root):
        for name in sorted(files):
            if pattern is None or name.endswith(pattern):
                yield os.path.join(directory, name)


def main(argv):
    total = 0
    for path in walk(argv[1], ".py"):
        with open(path) as f:
            total += len(f.read().splitlines())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''
SHORT = "class Stack:\n    def __init__(self):"
PARAMS = [
    SamplingParams(temperature=0, max_tokens=4, logprobs=0),
    SamplingParams(temperature=0.8, max_tokens=4, logprobs=0, seed=7),
]
COMMON = dict(accelerator="cpu", dtype="float32", max_num_seqs=4)


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    # compact runs the consumer layers on fewer rows than mask: equal only row for row
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _run(mode: str, prompts: list[str], **kwargs) -> list:
    llm = LLM(str(CHECKPOINT), yoco_prefill_truncation_mode=mode, **COMMON, **kwargs)
    outs = llm.generate(prompts, PARAMS[: len(prompts)], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(speculative_tokens=0),
        dict(speculative_tokens=5),
        dict(speculative_tokens=0, max_num_batched_tokens=64),
        dict(speculative_tokens=5, max_num_batched_tokens=64),
    ],
    ids=["whole, no drafts", "whole, 5 drafts", "chunked, no drafts", "chunked, 5 drafts"],
)
def test_compact_equals_mask_through_the_engine(kwargs):
    assert len(load_tokenizer(CHECKPOINT).encode(LONG)) > 128 + 5
    prompts = [LONG, SHORT]
    assert _run("compact", prompts, **kwargs) == _run("mask", prompts, **kwargs)


def test_a_keep_of_the_whole_prompt_equals_off(monkeypatch):
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")  # the same rows run either way
    keep = dict(speculative_tokens=0, yoco_prefill_keep_tokens=200)
    assert _run("compact", [SHORT], **keep) == _run("off", [SHORT], **keep)


def test_bad_settings_fail_at_start_up_in_one_line():
    with pytest.raises(ValueError, match=r"yoco_prefill_keep_tokens=130: expected >= .* 128 \+ 5"):
        LLM(str(CHECKPOINT), speculative_tokens=5, yoco_prefill_truncation_mode="compact",
            yoco_prefill_keep_tokens=130, **COMMON)  # fmt: skip
    with pytest.raises(ValueError, match="yoco_prefill_truncation_mode='on': expected one of"):
        LLM(str(CHECKPOINT), yoco_prefill_truncation_mode="on", **COMMON)


def test_a_prompt_logprobs_request_fails_alone_under_truncation():
    llm = LLM(str(CHECKPOINT), speculative_tokens=0, yoco_prefill_truncation_mode="mask", **COMMON)
    plain = SamplingParams(temperature=0, max_tokens=2)
    wanted = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    outs = llm.generate([SHORT, SHORT, SHORT], [plain, wanted, plain], use_tqdm=False)
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "request 1: prompt_logprobs=1 cannot be computed" in failed.error
    assert "yoco_prefill_truncation_mode='mask'" in failed.error
    assert not any(outs[1].prompt_logprobs or [])  # nothing computed
    for out in (outs[0], outs[2]):
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].error is None
        assert len(out.outputs[0].token_ids) == 2
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
