"""Sampler speed on the GPU: our pipeline vs torch sort-based top-p + multinomial.

Rows x vocab defaults to 256 x 129,280 (DeepSeek-V4's vocabulary). Each variant is timed with
CUDA events around one call after warm-up (the GPU idle at the start, so host work before the
first kernel counts); the table shows the median (and p10/p90) of many runs in milliseconds;
``--out`` writes the same numbers as JSON (rewritten after every variant, so a run cut short
keeps what it measured).

    python -m benchmarks.sampling.bench_sampler --out benchmarks/sampling/results.json

Variants:
  sample() ...             the public ``deepinfer.sampling.sample`` (host prep included); on
                           CUDA the draw is a captured graph after the second call (``eager``:
                           ``DEEPINFER_ENFORCE_EAGER=1``)
  sample() back-to-back    20 calls between two events, per call: host and device overlap
  graph replay only        the captured graph alone: the device time of the draw
  ops ...                  the device ops called directly (eager launches)
  torch sort top-k+top-p   softmax, sort, cumsum top-p mask, top-k mask, torch.multinomial
  torch argmax / copy      the greedy floor / one read + one write of the logits
  sample() knobs ...       the cutoff's tuning knobs (``sampling_draw.cutoff_and_draw``
                           defaults patched; ``--no-variants`` skips them)

Also: host-only time (CPU wall time of one ``sample()`` call, not synchronised, GPU idle at its
start) and device-only time (torch.profiler's kernel times per call, eager and graphed).
``BENCH_COMMIT`` overrides the commit recorded (machines without ``.git``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from deepinfer import kernels
from deepinfer.sampling import SamplingParams, graphs, sample

DEVICE = "cuda"


def _time_ms(fn: Callable[[], object], runs: int, warmup: int = 10) -> list[float]:
    if DEVICE != "cuda":  # --smoke: wall time
        return [t / 1e3 for t in _host_us(fn, runs, warmup)]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _host_us(fn: Callable[[], object], runs: int, warmup: int = 10) -> list[float]:
    """CPU wall time of one call, the GPU idle at its start, no synchronisation inside."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        _sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    _sync()
    return times


@contextlib.contextmanager
def _eager():
    os.environ["DEEPINFER_ENFORCE_EAGER"] = "1"
    try:
        yield
    finally:
        del os.environ["DEEPINFER_ENFORCE_EAGER"]


def _torch_baseline(logits, temperature, top_k, top_p):
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = (cumulative - sorted_probs) > top_p
    drop[:, top_k:] = True
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    choice = torch.multinomial(sorted_probs, 1)
    return order.gather(1, choice).squeeze(1)


def _setup(rows: int, vocab: int, top_k: int, top_p: float) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen) * 4.0

    def params(**kw):
        return [SamplingParams(temperature=0.8, seq_seed=i, **kw) for i in range(rows)]

    return dict(
        logits=logits,
        positions=list(range(1000, 1000 + rows)),
        topk_topp=params(top_k=top_k, top_p=top_p),
        top_p_only=params(top_p=top_p),
        min_p_only=params(min_p=0.05),
        greedy=[SamplingParams(temperature=0.0) for _ in range(rows)],
        op_args=(
            logits,
            torch.full((rows,), 0.8, device=DEVICE),
            torch.full((rows,), top_k, dtype=torch.int32, device=DEVICE),
            torch.full((rows,), top_p, device=DEVICE),
            torch.zeros(rows, device=DEVICE),
            torch.arange(rows, device=DEVICE),
            torch.arange(1000, 1000 + rows, device=DEVICE),
        ),
    )


def _variants(s: dict, top_k: int, top_p: float) -> dict[str, Callable[[], object]]:
    logits, positions = s["logits"], s["positions"]
    logits_t, temp, k, p, min_p, seeds, pos = s["op_args"]

    def pipeline(name):
        return lambda: sample(logits, s[name], positions)

    def eager(name):
        def run():
            with _eager():
                return sample(logits, s[name], positions)

        return run

    def back_to_back():  # events around 20 calls: the table divides by 20
        for _ in range(20):
            sample(logits, s["topk_topp"], positions)

    def two_ops():
        cut = kernels.top_k_top_p_min_p_cutoff(logits_t, temp, k, p, min_p)
        return kernels.gumbel_sample(logits_t, temp, cut, seeds, pos, 0)

    return {
        "sample() top-k+top-p": pipeline("topk_topp"),
        "sample() top-k+top-p, eager": eager("topk_topp"),
        "sample() greedy": pipeline("greedy"),
        "sample() top-p only": pipeline("top_p_only"),
        "sample() top-p only, eager": eager("top_p_only"),
        "sample() min-p only": pipeline("min_p_only"),
        "sample() top-k+top-p, back-to-back x20": back_to_back,
        "ops top_k_top_p_min_p_sample (one op)": lambda: kernels.top_k_top_p_min_p_sample(
            *s["op_args"], 0
        ),
        "ops cutoff + gumbel_sample (two ops)": two_ops,
        "ops cutoff only": lambda: kernels.top_k_top_p_min_p_cutoff(logits_t, temp, k, p, min_p),
        "torch sort top-k+top-p + multinomial": lambda: _torch_baseline(logits, 0.8, top_k, top_p),
        "torch argmax": lambda: torch.argmax(logits, dim=-1),
        "torch copy (1 read + 1 write)": lambda: logits.clone(),
    }


KNOBS = [dict(sort_cap=1024), dict(sort_cap=0), dict(sort_cap=64, cap=2048)]


def _knob_variants(s: dict) -> dict[str, Callable[[], object]]:
    """``sample()`` with the cutoff's knobs patched (graphs reset so each knob set captures its
    own graph)."""
    from deepinfer.kernels_nvidia import sampling_draw  # the tuning knobs live there

    defaults = sampling_draw.cutoff_and_draw.__kwdefaults__

    def with_knobs(knobs):
        saved = dict(defaults)

        def run():
            defaults.update(knobs)
            try:
                return sample(s["logits"], s["topk_topp"], s["positions"])
            finally:
                defaults.update(saved)

        return run

    return {
        "sample() top-k+top-p, knobs " + " ".join(f"{k}={v}" for k, v in kn.items()): with_knobs(kn)
        for kn in KNOBS
    }


def _graph_replay(s: dict) -> Callable[[], object] | None:
    """The captured graph of the default top-k + top-p call, replayed alone."""
    graphs.reset()
    try:
        for _ in range(3):
            sample(s["logits"], s["topk_topp"], s["positions"])
    except Exception as e:  # reported by the table's own sample() rows
        print(f"graph replay: sample() failed: {type(e).__name__}: {str(e)[:300]}")
        return None
    captured = list(graphs._policy.captured.values())
    return captured[0].graph.replay if captured else None


def _kernel_table(fn: Callable[[], object], iters: int = 20) -> dict[str, float]:
    """Device microseconds per call of each kernel, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    table = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time_total", 0.0)
        if device_us > 0:
            table[event.key] = device_us / iters
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def _commit() -> str:
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _summary(times: list[float], scale: float = 1.0) -> dict[str, float]:
    times = sorted(t / scale for t in times)
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[len(times) // 10],
        "p90_ms": times[(9 * len(times)) // 10],
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run_table(variants, runs: int, report: dict, save) -> None:
    print(f"{'variant':52s} {'median ms':>10s} {'p10':>8s} {'p90':>8s}")
    for name, fn in variants.items():
        if "knobs" in name:
            graphs.reset()
        try:
            row = _summary(_time_ms(fn, runs), 20.0 if "x20" in name else 1.0)
        except Exception as e:  # one broken variant must not cost the others' numbers
            report["results"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{name:52s} FAILED {type(e).__name__}: {str(e)[:300]}")
            save()
            continue
        report["results"][name] = row
        print(f"{name:52s} {row['median_ms']:10.4f} {row['p10_ms']:8.4f} {row['p90_ms']:8.4f}")
        save()
    graphs.reset()


def _host_and_device(variants, runs: int, report: dict, save, profile: bool) -> None:
    calls = {
        "graphed": variants["sample() top-k+top-p"],
        "eager": variants["sample() top-k+top-p, eager"],
    }
    report["host_only_us"], report["device_only"] = {}, {}
    for name, fn in calls.items():
        times = sorted(_host_us(fn, runs))
        host = {"median_us": statistics.median(times), "p10_us": times[len(times) // 10]}
        report["host_only_us"][name] = host
        print(f"host-only sample() top-k+top-p, {name}: median {host['median_us']:.1f} us")
        save()
    for name, fn in calls.items() if profile else ():
        table = _kernel_table(fn)
        report["device_only"][name] = {"kernels_us": table, "total_us": sum(table.values())}
        print(f"device-only sample() top-k+top-p, {name}: {sum(table.values()):.1f} us/call")
        for kernel, us in table.items():
            print(f"  {us:9.2f}  {kernel[:90]}")
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    parser.add_argument("--no-variants", action="store_true", help="skip the knob sweep")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, reference ops, tiny shape: checks the script"
    )
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE, args.rows, args.vocab, args.runs = "cpu", 4, 512, 2
        kernels.set_accelerator("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_sampler.py needs a CUDA GPU (or --smoke)")
    else:
        kernels.set_accelerator("nvidia")
    import triton

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)",
        "commit": _commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": {**vars(args), "out": os.path.basename(args.out or "")},
        "bytes_one_logits_read": args.rows * args.vocab * 4,
        "results": {},
    }

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)

    print(f"{args.rows} rows x {args.vocab} vocab, top_k={args.top_k}, top_p={args.top_p}")
    s = _setup(args.rows, args.vocab, args.top_k, args.top_p)
    variants = _variants(s, args.top_k, args.top_p)
    table = dict(variants)
    replay = _graph_replay(s)
    if replay is not None:
        table["graph replay only (device time of the draw)"] = replay
    if not (args.no_variants or args.smoke):
        table.update(_knob_variants(s))
    _run_table(table, args.runs, report, save)
    _host_and_device(variants, args.runs, report, save, profile=DEVICE == "cuda")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
