"""The shipped tiny model (examples/tiny_model/checkpoint), end to end on CPU: its format and
size, Python-shaped greedy text, and DSpark speculation that is both exact and worth it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.engine import LLM, SamplingParams

CHECKPOINT = Path(__file__).resolve().parents[1] / "examples" / "tiny_model" / "checkpoint"
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef",
    "class Stack:",
    "for i in range(",
    "def read_file(path):",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def test_checkpoint_is_the_official_v41_layout_within_budget():
    files = {p.name: p.stat().st_size for p in CHECKPOINT.iterdir()}
    assert sum(files.values()) <= 40 * 2**20
    shards = [n for n in files if n.endswith(".safetensors")]
    assert shards and all(files[n] <= 15 * 10**6 for n in shards)
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["text_config"]["num_nextn_predict_layers"] == 3
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert any(n.startswith("mtp.2.markov_head.") for n in names)  # the DSpark heads ship
    assert any(n.endswith(".scale") for n in names)  # FP8 / FP4 block scales


@pytest.fixture(scope="module")
def runs(request):
    """Greedy completions without and with speculation (5 drafts), batch invariant."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    request.addfinalizer(mp.undo)
    common = dict(accelerator="cpu", dtype="float32", max_num_seqs=8)
    plain = LLM(str(CHECKPOINT), speculative_tokens=0, **common)
    spec = LLM(str(CHECKPOINT), speculative_tokens=5, **common)
    return (plain.generate(PROMPTS, GREEDY, use_tqdm=False),
            spec.generate(PROMPTS, GREEDY, use_tqdm=False))  # fmt: skip


@pytest.mark.slow
def test_greedy_text_is_python_shaped(runs):
    """Indentation and Python keywords / docstrings, not byte noise, in at least 4 of the 5
    completions (the model is small and partly trained: one prompt degenerates into a loop)."""
    plain, _ = runs
    keywords = ("return", "self", '"""', "def ", "if ", "import", "#")
    shaped = 0
    for out in plain:
        text = out.outputs[0].text
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        shaped += "\n    " in text and any(w in text for w in keywords)
    assert shaped >= 4, [o.outputs[0].text for o in plain]


@pytest.mark.slow
def test_speculation_is_exact_and_accepts_two_tokens_per_step(runs):
    plain, spec = runs
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    metrics = [o.metrics for o in spec]
    steps = sum(m.num_verify_steps for m in metrics)
    accepted = sum(m.num_accepted_tokens for m in metrics)
    assert all(m.num_accepted_tokens <= m.num_draft_tokens for m in metrics)
    assert (accepted + steps) / steps >= 2.0  # tokens per verify step, bonus included
