"""``deepinfer bench``: the prefill/decode sweep of ``benchmarks/run_sweep.sh``.

The sweep lives in the repository (``benchmarks/sweep/``), not in an installed package, so the
command finds the checkout from the working directory or from this file and fails with a clear
message outside one; it runs the sweep as the module ``benchmarks.sweep.run_sweep`` with the
checkout's root on ``PYTHONPATH``, as ``benchmarks/run_sweep.sh`` does. Every argument after ``bench`` is passed to the sweep unchanged
(``deepinfer bench --help`` prints the sweep's own options).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

SWEEP = Path("benchmarks") / "sweep" / "run_sweep.py"


def find_sweep(start: Path | None = None) -> Path:
    """The sweep script of the checkout holding ``start`` (default: cwd) or this file."""
    candidates = [start or Path.cwd(), Path(__file__).resolve()]
    for origin in candidates:
        for directory in (origin, *origin.parents):
            if (directory / SWEEP).is_file():
                return directory / SWEEP
    raise FileNotFoundError(
        f"deepinfer bench: {SWEEP} not found above {candidates[0]} or the installed package; "
        "run it from a DeepInfer source checkout"
    )


def _bench(args: argparse.Namespace) -> int:
    root = find_sweep().parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks.sweep.run_sweep", *args.sweep_args]
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(command, check=False, env=env).returncode


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench``; its arguments are not parsed here but forwarded to the sweep."""
    bench = subparsers.add_parser(
        "bench",
        help="prefill/decode sweeps with a transformers baseline and the roofline "
        "(needs a source checkout; see benchmarks/RESULTS.md)",
        add_help=False,
        prefix_chars="\x00",  # no options of its own: '--smoke' etc. reach the sweep intact
    )
    bench.add_argument("sweep_args", nargs="*")
    bench.set_defaults(func=_bench)
