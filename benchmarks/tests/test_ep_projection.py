"""The one-GPU EP projection never rots: its ``--tiny`` CPU mode runs as a program and writes a
rank's numbers, and the full-size rank 0 it builds holds exactly its share of the experts (the rest is replicated
by construction)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.parallel.ep_projection import LoopbackComm, _bytes, model_config
from deepinfer.engine.model.model import build_model
from deepinfer.parallel import ExpertParallelContext

REPO = Path(__file__).resolve().parents[2]


def test_tiny_projection_runs_and_writes_json(tmp_path) -> None:
    out = tmp_path / "ep.json"
    args = ["--model", "v4-flash", "--ep", "2", "--tiny", "--prompt-len", "16",
            "--decode-batch", "2", "--context", "8", "--repeats", "1", "--out", str(out)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "benchmarks.parallel.ep_projection", *args],
                   check=True, cwd=REPO, timeout=300)  # fmt: skip
    result = json.loads(out.read_text())
    full = build_model(model_config("v4-flash", True, 0), device="meta", dtype=torch.float32)
    assert result["routed_expert_bytes"] * 2 == _bytes(full, True)
    assert result["other_weight_bytes"] == _bytes(full, False)
    assert result["prefill_step_s"] > 0 and result["decode_step_s"] > 0


@pytest.mark.parametrize(("name", "ep", "layers"), [("v4-flash", 2, 43), ("v41-flash", 8, 40)])
def test_full_size_rank0_holds_its_share_of_the_experts(name, ep, layers) -> None:
    config = model_config(name, False, 1 << 10)
    rank0 = build_model(
        config, device="meta", expert_parallel=ExpertParallelContext(LoopbackComm(ep))
    )
    assert config.num_layers == layers
    experts = [m.experts for m in rank0.modules() if getattr(m, "ep", None) is not None]
    assert len(experts) == layers
    assert all(len(e) == config.n_routed_experts // ep for e in experts)
    per_expert = _bytes(next(iter(experts[0].values())), False)
    assert _bytes(rank0, True) * ep == per_expert * config.n_routed_experts * layers
