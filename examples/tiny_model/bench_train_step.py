"""Time the tiny backbone's training step at a few batch sizes (the inputs of the recipe's
``--batch`` / ``--steps`` choice).

For each ``--batches`` size: a fresh model, ``--warmup`` untimed steps, then ``--steps`` timed
plain steps and ``--qat-steps`` timed quantisation-aware steps (forward + backward + clip +
AdamW + expert balancing, exactly ``train.py``'s step), device-synchronised; peak memory per
size. ``--compare-gather`` times the gather twin too at the first size; ``--profile`` writes a
``torch.profiler`` table of one step at the last size.

    python -m examples.tiny_model.bench_train_step --batches 64 96 128 --out bench.json

Prints a table and writes ``--out`` (JSON: device, commit from ``BENCH_COMMIT``, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from . import train as tr
from .quantise import quant_groups
from .tiny_common import (
    TRAIN_SEQ_LEN,
    build_model,
    load_tokens,
    trainable_parameters,
    training_batch,
)
from .training_run import sync_time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--seq-len", type=int, default=TRAIN_SEQ_LEN)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--qat-steps", type=int, default=2)
    p.add_argument("--compare-gather", action="store_true")
    p.add_argument("--profile", type=Path, default=None, help="profiler table of one step here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data-dir", type=Path, default=tr.DATA_DIR)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def train_args(batch: int, seq_len: int, device: str, data_dir: Path, twin: str):
    argv = ["--batch", str(batch), "--seq-len", str(seq_len), "--device", device]
    argv += ["--out", "unused", "--data-dir", str(data_dir), "--steps", "1000"]
    return tr.parse_args(argv + ["--attention-twin", twin])


def measure(batch: int, args: argparse.Namespace, twin: str, profile: Path | None) -> dict:
    """Seconds per plain / QAT step and peak memory of one batch size."""
    targs = train_args(batch, args.seq_len, args.device, args.data_dir, twin)
    tr.setup(targs)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tokens = load_tokens("train", args.data_dir)
    model = build_model(device, seed=0)
    opt, schedule = tr.make_optimizer(model, targs)
    balancer = tr.ExpertBalancer(model, targs.balance_rate)
    qat = quant_groups(model, tr._quantised_config())
    tb = training_batch(model.config, batch, args.seq_len, device)
    params = [p for _, p in trainable_parameters(model)]
    losses: list[torch.Tensor] = []

    def step(i: int, quantised: bool) -> None:
        loss = tr._train_step(model, tb, tokens, targs, i, qat if quantised else None)
        torch.nn.utils.clip_grad_norm_(params, targs.clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        balancer.update()
        losses.append(loss)

    with tr.twins(targs, model, tb.cache.ring_size) as dense:
        for i in range(args.warmup):
            step(i, quantised=False)
        plain_s = _timed(lambda i: step(i, False), args.warmup, args.steps, device)
        qat_s = _timed(lambda i: step(i, True), args.warmup + args.steps, args.qat_steps, device)
        if profile is not None:
            _profile(lambda: step(0, False), profile, device)
        if dense is not None:
            dense.raise_on_violations()
    row = {
        "batch": batch,
        "seq_len": args.seq_len,
        "attention_twin": twin,
        "step_s": round(plain_s, 4),
        "qat_step_s": round(qat_s, 4) if args.qat_steps else None,
        "tokens_per_s": round(batch * args.seq_len / plain_s),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
        "losses": [round(float(x), 4) for x in losses],
    }
    return row


def _timed(fn, first: int, count: int, device) -> float:
    if count <= 0:
        return float("nan")
    t0 = sync_time(device)
    for i in range(first, first + count):
        fn(i)
    return (sync_time(device) - t0) / count


def _profile(fn, path: Path, device) -> None:
    with torch.profiler.profile() as prof:
        fn()
        sync_time(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40))


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows = []
    for i, batch in enumerate(args.batches):
        last = i == len(args.batches) - 1
        rows.append(measure(batch, args, "dense", args.profile if last else None))
        _print_row(rows[-1])
        if args.compare_gather and i == 0:
            rows.append(measure(batch, args, "gather", None))
            _print_row(rows[-1])
        _write(args, rows)
    return {"rows": rows}


def _print_row(r: dict) -> None:
    print(
        f"batch {r['batch']:>4} x {r['seq_len']} {r['attention_twin']:>6}: {r['step_s']:.3f} s/step"
        f" (QAT {r['qat_step_s']}), {r['tokens_per_s']:,} tok/s, peak {r['peak_memory_gib']} GiB;"
        f" losses {r['losses']}",
        flush=True,
    )


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.out is None:
        return
    facts = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": os.environ.get("BENCH_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(facts, indent=1) + "\n")


if __name__ == "__main__":
    main()
