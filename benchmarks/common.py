"""Shared helpers for benchmark scripts: device-event timing, the copy-bandwidth ceiling, the
environment record and the table/JSON output. Benchmarks are scripts, never timed tests."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def time_cuda(fn: Callable[[], Any], *, warmup: int = 10, iters: int = 100) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events after warm-up.

    The L2 cache (50 MB on H200) is flushed before each run so bandwidth numbers are HBM numbers.
    """
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 100) -> float:
    """Median ms of replaying ``fn()`` captured in a CUDA graph: device time without the host's
    per-launch overhead, which dominates decode-sized kernels timed eagerly."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, warmup=warmup, iters=iters)


def copy_bandwidth_tbs(num_bytes: int = 2 * 2**30) -> float:
    """Measured device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=5, iters=30)
    return 2 * num_bytes / (ms * 1e-3) / 1e12


def environment() -> dict[str, Any]:
    import os

    import triton

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        # The GPU machine's copy of the tree may lack .git or carry a stale one: BENCH_COMMIT,
        # when given, names the commit that was measured.
        "commit": os.environ.get("BENCH_COMMIT") or commit or "unknown",
    }


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    if not rows:
        return
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
