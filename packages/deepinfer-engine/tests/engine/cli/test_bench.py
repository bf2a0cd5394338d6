"""``deepinfer bench`` forwards its arguments to the repository's sweep unchanged."""

from __future__ import annotations

import argparse
import os

import pytest

from deepinfer.engine.cli import bench as cli_bench


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer")
    cli_bench.add_bench_command(parser.add_subparsers(dest="command", required=True))
    return parser


def test_bench_forwards_every_argument_to_the_sweep(monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(
        cli_bench.subprocess, "run",
        lambda cmd, check, env: calls.append((cmd, env)) or argparse.Namespace(returncode=3),
    )  # fmt: skip
    args = _parser().parse_args(["bench", "--smoke", "--out", str(tmp_path), "--help"])
    assert args.func(args) == 3
    ((cmd, env),) = calls
    assert cmd[1:3] == ["-m", "benchmarks.sweep.run_sweep"]
    assert cmd[3:] == ["--smoke", "--out", str(tmp_path), "--help"]
    root = cli_bench.find_sweep().parents[2]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(root)


def test_bench_outside_a_checkout_fails_with_a_clear_message(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cli_bench, "__file__", str(tmp_path / "cli_bench.py"))
    with pytest.raises(FileNotFoundError, match="source checkout"):
        cli_bench.find_sweep(tmp_path)
