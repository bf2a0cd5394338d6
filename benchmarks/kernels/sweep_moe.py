"""Throwaway exploration sweep for the FP4-expert MoE kernels (V4-Flash shape, group 128): every
variant compiled in parallel subprocesses first (a shared Triton cache), then timed one after the
other with device events, eager and (decode) from a CUDA graph; each output checked against the
reference.

    BENCH_COMMIT=abc python benchmarks/kernels/sweep_moe.py --out bench-out/sweep.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import environment, print_table, time_cuda, time_graph, write_json  # noqa: E402

from deepinfer.kernels import OPS  # noqa: E402
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight  # noqa: E402
from deepinfer.kernels_nvidia import moe_experts  # noqa: E402
from deepinfer.kernels_nvidia.moe_experts import MoeTiles  # noqa: E402

EXPERTS, DIM, INTER, GROUP, TOP_K = 256, 4096, 2048, 128, 6
CONFIGS = [
    ("decode", "old-bf16-16x64", MoeTiles(16, 64, 4, 4)),
    ("decode", "fp8-swap-16x128-s4", MoeTiles(16, 128, 4, 4, mma="fp8", swap_ab=True)),
    ("decode", "fp16-swap-16x128-s4", MoeTiles(16, 128, 4, 4, mma="fp16", swap_ab=True)),
    ("decode", "fp8-swap-16x128-s6-dn64",
     MoeTiles(16, 128, 4, 6, mma="fp8", swap_ab=True, down_block_n=64)),
    ("decode", "fp8-noswap-16x128-s4", MoeTiles(16, 128, 4, 4, mma="fp8")),
    ("prefill", "old-bf16-128x128", MoeTiles(128, 128, 8, 2)),
    ("prefill", "fp8-128x128-w8s3", MoeTiles(128, 128, 8, 3, mma="fp8")),
    ("prefill", "fp8-64x128-w4s4", MoeTiles(64, 128, 4, 4, mma="fp8")),
    ("prefill", "fp8-swap-128x128-w8s3", MoeTiles(128, 128, 8, 3, mma="fp8", swap_ab=True)),
    ("prefill", "fp16-128x128-w8s3", MoeTiles(128, 128, 8, 3, mma="fp16")),
    ("prefill", "fp8-128x128-w8s3-noasm", MoeTiles(128, 128, 8, 3, mma="fp8", use_asm=False)),
    ("prefill", "fp8-64x128-w4s3-dn256",
     MoeTiles(64, 128, 4, 3, mma="fp8", down_block_n=256)),
]  # fmt: skip
BREAKDOWN = ("fp8-swap-16x128-s4", "fp8-128x128-w8s3", "old-bf16-128x128")
TOKENS = {"decode": 64, "prefill": 8192}


def make_inputs(tokens):
    g = torch.Generator(device="cuda").manual_seed(7)
    w13, s13 = random_fp4_weight(g, (EXPERTS, 2 * INTER, DIM), "cuda")
    w2, s2 = random_fp4_weight(g, (EXPERTS, DIM, INTER), "cuda")
    g.manual_seed(tokens)
    x = torch.randn(tokens, DIM, generator=g, device="cuda").bfloat16()
    scores = torch.rand(tokens, EXPERTS, generator=g, device="cuda")
    ids = scores.topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, generator=g, device="cuda") + 0.25
    return (x, weights, ids, w13, s13, w2, s2)


def run_config(args, tiles):
    return moe_experts.fp4_moe_experts_tiles(
        *args, swiglu_limit=10.0, act_quant_group=GROUP, tiles=tiles
    )


def warm(index: int) -> None:
    phase, _, tiles = CONFIGS[index]
    run_config(make_inputs(TOKENS[phase]), tiles)
    torch.cuda.synchronize()


def breakdown(args, tiles) -> dict[str, float]:
    """Mean device microseconds per kernel name over 5 calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run_config(args, tiles)
        torch.cuda.synchronize()
    return {e.key[:60]: e.device_time_total / 5 for e in prof.key_averages()
            if e.device_time_total > 0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--warm", type=int, default=None)
    opts = parser.parse_args()
    if opts.warm is not None:
        return warm(opts.warm)
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", str(i)])
             for i in range(len(CONFIGS))]  # fmt: skip
    codes = [p.wait() for p in procs]
    print(f"compiled {len(CONFIGS)} configs in {time.time() - t0:.0f} s, exit codes {codes}")
    rows = []
    for phase, tokens in TOKENS.items():
        args = make_inputs(tokens)
        w13, s13, w2, s2 = args[3:]
        used = torch.unique(args[2]).numel()
        per_expert = (w13.numel() + s13.numel() + w2.numel() + s2.numel()) // EXPERTS
        flops, nbytes = 6 * tokens * TOP_K * DIM * INTER, used * per_expert
        want = OPS["fp4_moe_experts"].reference(*args, swiglu_limit=10.0, act_quant_group=GROUP)
        spread = want.std().item()
        for p, name, tiles in CONFIGS:
            if p != phase:
                continue
            row = {"phase": phase, "config": name, "tokens": tokens, "experts_used": used}
            try:
                got = run_config(args, tiles)
                row["max_err_rel"] = ((got - want).abs().max() / spread).item()
                row["mean_err_rel"] = ((got - want).abs().mean() / spread).item()
                ms = time_cuda(lambda t=tiles, a=args: run_config(a, t), warmup=3, iters=20)
                row["us"], row["TFLOP/s"] = ms * 1e3, flops / ms / 1e9
                row["TB/s"] = nbytes / ms / 1e9
                if phase == "decode":
                    ms = time_graph(lambda t=tiles, a=args: run_config(a, t), iters=50)
                    row["graph_us"], row["graph_TB/s"] = ms * 1e3, nbytes / ms / 1e9
                if name in BREAKDOWN:
                    row["kernels_us"] = breakdown(args, tiles)
            except Exception as e:  # one failing variant must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                   if k != "kernels_us"})  # fmt: skip
            for k, v in row.get("kernels_us", {}).items():
                print(f"    {v:9.1f} us  {k}")
            write_json(opts.out, {"env": environment(), "rows": rows})
        del args, want
        torch.cuda.empty_cache()
    cols = ["phase", "config", "us", "TFLOP/s", "TB/s", "graph_us", "graph_TB/s", "max_err_rel",
            "mean_err_rel", "error"]  # fmt: skip
    print_table(rows, cols)


if __name__ == "__main__":
    main()
