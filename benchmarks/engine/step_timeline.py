"""Per-step host time, device busy time and idle gaps of steady decode, without a sync per step.

``measure(llm, prompts, max_tokens)`` generates greedily twice (the first run warms up:
compilation, graph captures), then again with every ``EngineCore.step`` call timed on the host
(no synchronisation added, so asynchronous scheduling keeps its overlap) and, from the
``--skip``-th step on, ``torch.profiler`` recording device kernels only. Device numbers come
from the kernels' own intervals: the window runs from the first profiled kernel to the last;
busy time is the union of kernel intervals in it; idle time is the rest, reported per step
along with the longest gap and the count of gaps above 20 us, and where those gaps sit: per
(kernel before, kernel after) pair, their count and idle time per step (``gap_sites``, the
largest first). Without CUDA the device numbers are None (host times still come out).

    python -m benchmarks.engine.step_timeline --dummy-layers 4 --batch 64 --out t.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.sampling import SamplingParams

GAP_US = 20.0


class _StepClock:
    """Replaces ``core.step``: times every call; starts the profiler at call ``skip``."""

    def __init__(self, core, skip: int, profiler) -> None:
        self.core, self.inner, self.skip, self.profiler = core, core.step, skip, profiler
        self.calls, self.host_s = 0, []

    def __call__(self):
        self.calls += 1
        if self.calls == self.skip and self.profiler is not None:
            self.profiler.start()
        start = time.perf_counter()
        updates = self.inner()
        if self.calls >= self.skip:
            self.host_s.append(time.perf_counter() - start)
        return updates


def device_gaps(intervals: list[tuple[float, float]]) -> dict:
    """Busy union and idle gaps (microseconds) of kernel ``(start, end)`` intervals."""
    if not intervals:
        return {"window_us": 0.0, "busy_us": 0.0, "gaps": []}
    intervals = sorted(intervals)
    window = intervals[-1][1] - intervals[0][0]
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return {"window_us": window, "busy_us": busy, "gaps": gaps}


def _kernels(profiler) -> list[tuple[float, float, str]]:
    cuda = torch.autograd.DeviceType.CUDA
    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in profiler.events()
        if e.device_type == cuda and e.time_range.end > e.time_range.start
    ]


def gap_sites(kernels: list[tuple[float, float, str]], steps: int, top: int = 6) -> list[dict]:
    """Gaps above ``GAP_US`` between consecutive kernels, grouped by the names of the kernel
    that ends before and the one that starts after: count and idle ms per step, largest first."""
    sites: dict[tuple[str, str], list[float]] = {}
    kernels = sorted(kernels)
    if not kernels:
        return []
    end, last = kernels[0][1], kernels[0][2]
    for s, e, name in kernels[1:]:
        if s - end > GAP_US:
            sites.setdefault((last[:60], name[:60]), []).append(s - end)
        if e > end:
            end, last = e, name
    rows = [
        {"before": b, "after": a, "per_step": len(g) / steps, "ms_per_step": sum(g) / steps / 1e3}
        for (b, a), g in sites.items()
    ]
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def measure(llm, prompts: list[list[int]], max_tokens: int, *, skip: int = 3) -> dict:
    """Steady-decode timeline of one greedy generation (see the module docstring)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    profiler = None
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CUDA])
    core = llm._core
    clock = _StepClock(core, skip, profiler)
    core.step = clock
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del core.step
    steps = len(clock.host_s)
    result = {
        "batch": len(prompts), "async": core.async_scheduling, "steps": steps,
        "host_ms": statistics.median(clock.host_s) * 1e3 if steps else None,
        "wall_ms": sum(clock.host_s) / max(steps, 1) * 1e3,
        "gpu_busy_ms": None, "idle_ms": None, "busy_frac": None, "max_gap_ms": None,
        "gaps": None, "gap_sites": None,
    }  # fmt: skip
    if profiler is not None and clock.calls >= skip:
        torch.cuda.synchronize()
        profiler.stop()
        kernels = _kernels(profiler)
        timeline = device_gaps([(s, e) for s, e, _ in kernels])
        window, busy, gaps = timeline["window_us"], timeline["busy_us"], timeline["gaps"]
        result.update({
            "gpu_busy_ms": busy / steps / 1e3, "idle_ms": (window - busy) / steps / 1e3,
            "busy_frac": busy / window if window else None,
            "max_gap_ms": max(gaps, default=0.0) / 1e3,
            "gaps": sum(1 for g in gaps if g > GAP_US) / steps,
            "gap_sites": gap_sites(kernels, steps),
        })  # fmt: skip
    return result


def set_async(llm, enabled: bool) -> None:
    """Switch asynchronous scheduling of ``llm`` (finishing a step left in flight first)."""
    core = llm._core
    if core._in_flight is not None:
        core._finish_in_flight()
    core.async_scheduling = enabled


COLUMNS = ["batch", "async", "steps", "host_ms", "wall_ms", "gpu_busy_ms", "idle_ms",
           "busy_frac", "max_gap_ms", "gaps"]  # fmt: skip


def main(argv=None) -> list[dict]:
    from benchmarks.common import environment, print_table, write_json
    from benchmarks.engine.profile_decode import _load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    p.add_argument("--dummy-layers", type=int, default=0,
                   help="a dummy-weight V4-Flash-shaped model of this many layers instead")  # fmt: skip
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--async", dest="modes", default="on,off", help="on, off or on,off")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from benchmarks.engine.profile_decode import REPO

        args.model = str(REPO / "examples" / "tiny_model" / "checkpoint")
    llm, vocab = _load(args)
    rows = []
    for mode in args.modes.split(","):
        set_async(llm, mode == "on")
        for batch in (int(b) for b in args.batch.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
            rows.append(measure(llm, prompts, args.tokens))
    print_table(rows, COLUMNS)
    for row in rows:
        for site in row["gap_sites"] or []:
            print(
                f"  batch {row['batch']} async {row['async']}: {site['ms_per_step']:.3f} ms/step in "
                f"{site['per_step']:.2f} gaps/step, {site['before']} -> {site['after']}"
            )
    write_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
