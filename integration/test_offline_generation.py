"""The README's main job and the LLM API, end to end, on the embedded default checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "examples" / "default_model"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT_MODEL), accelerator="cpu", dtype="float32", max_num_seqs=40)


def test_offline_example_generates_for_every_prompt():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--max-tokens", "5"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "DEEPINFER_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("completion:") == 4
    # sampled tokens depend on the machine's float rounding, so a sample may draw EOS (a
    # "stop" that counts its EOS token) before the 5-token limit
    finishes = re.findall(r"tokens: (\d+), finish: (\w+)", proc.stdout)
    assert len(finishes) == 4, proc.stdout
    for count, reason in finishes:
        assert (reason, int(count)) == ("length", 5) or (reason == "stop" and 1 <= int(count) <= 5)


def test_generate_cli_reads_stdin_and_writes_jsonl():
    proc = subprocess.run(
        [str(BIN / "deepinfer"), "generate", "--model", str(DEFAULT_MODEL), "--accelerator",
         "cpu", "--max-tokens", "3", "--temperature", "0"],
        input="def f(x):\nimport sys\n", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["def f(x):", "import sys"]
    assert all(len(r["outputs"][0]["token_ids"]) == 3 for r in records)


def test_bad_inputs_fail_before_any_work_naming_the_request(llm):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"request 1.*empty"):
        llm.generate(prompt_token_ids=[[5, 6], []], sampling_params=greedy, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"request 0.*8192"):
        llm.generate(prompt_token_ids=[[5, 8192]], sampling_params=greedy, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"request 2.*max_model_len"):
        too_long = [[7] * 3, [7] * 3, [7] * 5000]
        llm.generate(prompt_token_ids=too_long, sampling_params=greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_invalid_grammar_fails_alone_and_valid_json_parses(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    good = SamplingParams(temperature=0.7, seed=1, max_tokens=40,
                          structured_outputs=StructuredOutputs(json=schema))  # fmt: skip
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputs(regex="(unclosed"))
    plain = SamplingParams(temperature=0, max_tokens=4)
    outputs = llm.generate(["x", "y", "z"], [good, bad, plain], use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].error
    assert outputs[2].outputs[0].finish_reason == "length"
    first = outputs[0].outputs[0]
    if first.finish_reason == "stop":  # the grammar finished within max_tokens
        assert isinstance(json.loads(first.text, strict=False)["a"], int)
    else:
        assert first.finish_reason == "length"


def test_seeded_sampling_is_identical_alone_and_in_a_batch(llm, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seq_seed=1234)
    others = SamplingParams(temperature=1.0, max_tokens=6)
    prompt = "def fibonacci(n):"
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = [f"line {i}: x = {i}" for i in range(32)]
    batch.insert(13, prompt)
    mixed = llm.generate(batch, [others] * 13 + [params] + [others] * 19, use_tqdm=False)
    assert mixed[13].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seq_seed=1235)
    assert llm.generate([prompt], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone
