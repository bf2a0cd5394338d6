"""Sampler speed on the GPU: our pipeline vs torch sort-based top-p + multinomial.

Rows x vocab defaults to 256 x 129,280 (DeepSeek-V4's vocabulary). Each variant is timed with
CUDA events around one call after warm-up; the table shows the median (and p10/p90) of many
runs in milliseconds; ``--out`` writes the same numbers as JSON.

    python benchmarks/sampling/bench_sampler.py --out benchmarks/sampling/results.json

Variants:
  sample() top-k+top-p    the public ``deepinfer.sampling.sample`` (host prep included)
  ops top-k+top-p         the device ops only: cutoff kernel + Gumbel draw kernel
  sample() greedy         the greedy fast path (every row temperature 0)
  torch sort top-k+top-p  softmax, sort, cumsum top-p mask, top-k mask, torch.multinomial
  torch argmax            torch.argmax over the logits (the greedy floor)
  cutoff <knobs>, gumbel fused_pick, sample() ... fused   the kernels' tuning knobs (imported
                          from the NVIDIA backend module directly: a kernel-tuning sweep;
                          ``--no-variants`` skips it)
  sample() top-p only / min-p only   the public pipeline with the other filters off

A torch.profiler pass over ``sample()`` lists the device time of each kernel (``kernels`` in
the JSON). ``BENCH_COMMIT`` overrides the commit recorded (machines without ``.git``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from deepinfer import kernels
from deepinfer.sampling import SamplingParams, sample


def _time_ms(fn: Callable[[], object], runs: int, warmup: int = 10) -> list[float]:
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


def _torch_baseline(logits, temperature, top_k, top_p):
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = (cumulative - sorted_probs) > top_p
    drop[:, top_k:] = True
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    choice = torch.multinomial(sorted_probs, 1)
    return order.gather(1, choice).squeeze(1)


def _variants(rows: int, vocab: int, top_k: int, top_p: float):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 4.0
    params = [
        SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seq_seed=i) for i in range(rows)
    ]
    greedy = [SamplingParams(temperature=0.0) for _ in range(rows)]
    positions = list(range(1000, 1000 + rows))
    temperature = torch.full((rows,), 0.8, device="cuda")
    k = torch.full((rows,), top_k, dtype=torch.int32, device="cuda")
    p = torch.full((rows,), top_p, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    pos = torch.tensor(positions, device="cuda")

    def ops():
        cut = kernels.top_k_top_p_min_p_cutoff(logits, temperature, k, p, min_p)
        return kernels.gumbel_sample(logits, temperature, cut, seeds, pos, 0)

    cut = kernels.top_k_top_p_min_p_cutoff(logits, temperature, k, p, min_p)
    top_p_only = [SamplingParams(temperature=0.8, top_p=top_p, seq_seed=i) for i in range(rows)]
    min_p_only = [SamplingParams(temperature=0.8, min_p=0.05, seq_seed=i) for i in range(rows)]
    return (
        {
            "sample() top-k+top-p": lambda: sample(logits, params, positions),
            "ops top-k+top-p": ops,
            "ops cutoff only": lambda: kernels.top_k_top_p_min_p_cutoff(
                logits, temperature, k, p, min_p
            ),
            "ops gumbel only (top-k cutoff)": lambda: kernels.gumbel_sample(
                logits, temperature, cut, seeds, pos, 0
            ),
            "ops gumbel only (cutoff 0: noise everywhere)": lambda: kernels.gumbel_sample(
                logits, temperature, min_p, seeds, pos, 0
            ),
            "sample() greedy": lambda: sample(logits, greedy, positions),
            "sample() top-p only": lambda: sample(logits, top_p_only, positions),
            "sample() min-p only": lambda: sample(logits, min_p_only, positions),
            "torch sort top-k+top-p": lambda: _torch_baseline(logits, 0.8, top_k, top_p),
            "torch argmax": lambda: torch.argmax(logits, dim=-1),
            "torch copy (1 read + 1 write)": lambda: logits.clone(),
        },
        (logits, temperature, k, p, min_p),
        (logits, temperature, cut, seeds, pos, 0),
        (params, positions),
    )


VARIANTS = [
    dict(cap=8192, sort_cap=1024, max_chunks=32),
    dict(cap=8192, sort_cap=1024, max_chunks=32, fused_finish=True),
    dict(cap=8192, sort_cap=0, max_chunks=32),
    dict(cap=8192, sort_cap=256, max_chunks=16),
    dict(cap=8192, sort_cap=2048, max_chunks=64),
    dict(cap=8192, sort_cap=1024, max_chunks=16),
    dict(cap=8192, sort_cap=1024, max_chunks=64),
]


def _kernel_variants(cutoff_args, gumbel_args, params, positions):
    """The kernels' tuning knobs, timed alone, and ``sample()`` with both fused variants on
    (their defaults patched for the call: the registered ops take no knobs)."""
    from deepinfer.kernels_nvidia import sampling as nv_sampling
    from deepinfer.kernels_nvidia import sampling_cutoff  # the tuning knobs live there

    def fused_sample():
        finish, pick = sampling_cutoff.cutoff.__kwdefaults__, nv_sampling.gumbel.__kwdefaults__
        finish["fused_finish"], pick["fused_pick"] = True, True
        try:
            return sample(cutoff_args[0], params, positions)
        finally:
            finish["fused_finish"], pick["fused_pick"] = False, False

    variants = {
        "cutoff " + " ".join(f"{k}={v}" for k, v in knobs.items()): (
            lambda knobs=knobs: sampling_cutoff.cutoff(*cutoff_args, **knobs)
        )
        for knobs in VARIANTS
    }
    variants["gumbel fused_pick=True"] = lambda: nv_sampling.gumbel(*gumbel_args, fused_pick=True)
    variants["sample() top-k+top-p, fused finish + pick"] = fused_sample
    return variants


def _kernel_table(params, positions, logits, iters: int = 20) -> dict[str, float]:
    """Device microseconds per ``sample()`` call of each kernel, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    sample(logits, params, positions)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            sample(logits, params, positions)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    parser.add_argument("--no-variants", action="store_true", help="skip the cutoff tuning sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler.py needs a CUDA GPU")
    kernels.set_accelerator("nvidia")
    results = {}
    print(f"{args.rows} rows x {args.vocab} vocab, top_k={args.top_k}, top_p={args.top_p}")
    print(f"{'variant':52s} {'median ms':>10s} {'p10':>8s} {'p90':>8s}")
    variants, cutoff_args, gumbel_args, (params, positions) = _variants(
        args.rows, args.vocab, args.top_k, args.top_p
    )
    if not args.no_variants:
        variants.update(_kernel_variants(cutoff_args, gumbel_args, params, positions))
    for name, fn in variants.items():
        times = sorted(_time_ms(fn, args.runs))
        row = {
            "median_ms": statistics.median(times),
            "p10_ms": times[len(times) // 10],
            "p90_ms": times[(9 * len(times)) // 10],
        }
        results[name] = row
        print(f"{name:52s} {row['median_ms']:10.4f} {row['p10_ms']:8.4f} {row['p90_ms']:8.4f}")
    kernel_us = _kernel_table(params, positions, cutoff_args[0])
    print("sample() top-k+top-p, device time per call by kernel (us):")
    for name, us in kernel_us.items():
        print(f"  {us:9.2f}  {name[:90]}")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "commit": _commit(),
        "torch": torch.__version__,
        "args": {**vars(args), "out": os.path.basename(args.out or "")},
        "results": results,
        "kernels_us": kernel_us,
        "bytes_one_logits_read": args.rows * args.vocab * 4,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
