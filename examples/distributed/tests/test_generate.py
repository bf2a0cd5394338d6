"""The distributed example under ``torchrun --nproc-per-node 2`` (CPU, gloo) gives the outputs
of the same script with ``LLM`` starting its own two workers (DP = EP = 2)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config
from examples.distributed.generate import parse_args, run

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v41")
    make_random_checkpoint(directory, tiny_v41_config(vision=False), quantized=True, seed=0)
    return directory


def test_torchrun_gives_the_outputs_of_llm_started_workers(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 250) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    argv = [
        "--model",
        str(checkpoint),
        "--accelerator",
        "cpu",
        "--block-size",
        "16",
        "--prompt-token-ids",
        str(tmp_path / "prompts.json"),
        "--max-tokens",
        "3",
        "--temperature",
        "0.9",
        "--seed",
        "7",
    ]
    env = {**os.environ, "DEEPINFER_BATCH_INVARIANT": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "examples.distributed.generate",
        *argv,
        "--out",
        str(tmp_path / "torchrun.json"),
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    from_torchrun = json.loads((tmp_path / "torchrun.json").read_text())
    spawned = run(parse_args([*argv, "--data-parallel-size", "2"]))
    assert [r["token_ids"] for r in from_torchrun] == [r["token_ids"] for r in spawned]
    assert all(len(r["token_ids"]) == 3 for r in spawned)
