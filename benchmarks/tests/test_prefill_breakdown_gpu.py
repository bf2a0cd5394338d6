"""The prefill breakdown's CUDA path: kernels are attributed to the ops that launched them,
host time sits beside kernel time, and the device idle row closes the step.

    python -m pytest benchmarks/tests/test_prefill_breakdown_gpu.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.engine import prefill_breakdown

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_breakdown_attributes_kernels_to_ops_on_cuda(tmp_path) -> None:
    from deepinfer.engine.testing import tiny_v4_config
    from deepinfer.engine.testing.random_checkpoint import make_random_checkpoint

    checkpoint = make_random_checkpoint(
        tmp_path / "v4", tiny_v4_config(num_nextn_predict_layers=0), quantized=True
    )
    out = tmp_path / "out"
    argv = ["--model", str(checkpoint), "--accelerator", "nvidia", "--shapes", "4x64",
            "--repeats", "1", "--gpu-memory-utilization", "0.1", "--out", str(out)]  # fmt: skip
    assert prefill_breakdown.main(argv) == 0
    (path,) = out.glob("*-prefill-breakdown-*.json")
    (shape,) = json.loads(path.read_text())["models"][0]["shapes"]
    rows = {row["op"]: row for row in shape["rows"]}
    for op in ("linear", "sparse_mqa_sink", "rms_norm"):
        assert rows[op]["ms"] > 0 and rows[op]["host_ms"] > 0 and rows[op]["ceiling_ms"] > 0
    assert "device idle (host)" in rows
    assert rows["linear"]["kernels_ms"] and rows["linear"]["kernels_ms"][0][1] > 0
    groups = shape["rows"][:-2]
    wall = rows["step (wall, profiled)"]["ms"]
    assert sum(row["ms"] for row in groups) <= wall * 1.05  # one stream: kernels fit the step
