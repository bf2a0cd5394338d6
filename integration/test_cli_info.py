"""`deepinfer info` as a user runs it: a subprocess of the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

DEEPINFER = shutil.which("deepinfer") or os.path.join(os.path.dirname(sys.executable), "deepinfer")


def _run(*args: str, accelerator: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ACCELERATOR"}
    if accelerator is not None:
        env["DEEPINFER_ACCELERATOR"] = accelerator
    return subprocess.run([DEEPINFER, *args], env=env, capture_output=True, text=True, timeout=120)


def test_info_on_cpu_lists_versions_selection_and_every_op():
    from deepinfer import kernels

    proc = _run("info", accelerator="cpu")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "deepinfer-kernels-nvidia" in out and "0.1.0" in out
    assert "accelerator: cpu (backend reference; cpu requested by DEEPINFER_ACCELERATOR)" in out
    for name in kernels.OPS:
        assert f"  {name} " in out
    rms_row = next(line for line in out.splitlines() if line.strip().startswith("rms_norm "))
    assert rms_row.split()[1:] == ["reference", "native", "reference", "fallback"]


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch_npu") is not None,
    reason="an NPU stack is present",
)
def test_info_with_a_missing_ascend_fails_with_one_line():
    proc = _run("info", accelerator="ascend")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("deepinfer: error: accelerator 'ascend'")


def test_help_explains_the_commands():
    proc = _run("--help", accelerator=None)
    assert proc.returncode == 0
    assert "info" in proc.stdout
