"""Throwaway sweep (issue 7, MoE decode v3): FP4 routed experts for a 64-token decode batch at
V4-Flash and V4.1-Flash shapes; moe_stream's chained-accumulator variants against the current
default and the fp16 swap-AB variant, each replayed from a CUDA graph, plus the launches around
the GEMMs timed alone. Variants compile in parallel subprocesses first.

    python benchmarks/kernels/sweep_moe.py --out bench-out/sweep_moe.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_tbs, environment, time_graph, write_json  # noqa: E402

from deepinfer.kernels import OPS  # noqa: E402
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight  # noqa: E402
from deepinfer.kernels_nvidia import moe_experts  # noqa: E402
from deepinfer.kernels_nvidia.moe_experts import MoeTiles  # noqa: E402
from deepinfer.kernels_nvidia.quant import quantize_rows  # noqa: E402

MODELS = {"V4-Flash": (256, 4096, 2048, 128), "V4.1-Flash": (384, 5120, 2304, 32)}
TOP_K, LIMIT, TOKENS = 6, 10.0, 64


def _t(mma, n, w, s, k=128, swap=True, dn=0, asm=True):
    return MoeTiles(16, n, w, s, mma=mma, swap_ab=swap, block_k=k, down_block_n=dn, use_asm=asm)


VARIANTS = {
    "default": None,
    "old-fp16-swap-n256": MoeTiles(16, 256, 8, 4, mma="fp16", swap_ab=True),
    "mx-swap-n128-k128-w4s4": _t("mx", 128, 4, 4),
    "mx-swap-n128-k256-w4s3": _t("mx", 128, 4, 3, k=256),
    "mx-swap-n64-k256-w4s4": _t("mx", 64, 4, 4, k=256),
    "mx-swap-n128-k128-w8s4": _t("mx", 128, 8, 4),
    "mx-swap-n256-k128-w8s3": _t("mx", 256, 8, 3),
    "mx-n64-k256-w4s4": _t("mx", 64, 4, 4, k=256, swap=False),
    "mx-n128-k128-w4s4": _t("mx", 128, 4, 4, swap=False),
    "f16-swap-n128-k128-w4s4": _t("fp16-stream", 128, 4, 4),
    "f16-swap-n128-k256-w4s3": _t("fp16-stream", 128, 4, 3, k=256),
    "f16-swap-n64-k256-w4s4": _t("fp16-stream", 64, 4, 4, k=256),
    "f16-swap-n128-k128-w8s4": _t("fp16-stream", 128, 8, 4),
    "f16-swap-n256-k128-w8s3": _t("fp16-stream", 256, 8, 3),
    "f16-swap-n128-k128-w4s4-noasm": _t("fp16-stream", 128, 4, 4, asm=False),
    "f16-n128-k128-w4s4": _t("fp16-stream", 128, 4, 4, swap=False),
}


def weights_for(model, experts=None):
    num_experts, dim, inter, _ = MODELS[model]
    experts = experts or num_experts
    g = torch.Generator(device="cuda").manual_seed(num_experts)
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), "cuda")
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), "cuda")
    return w13, s13, w2, s2


def inputs_for(model, weights):
    experts, dim = weights[0].shape[0], MODELS[model][1]
    g = torch.Generator(device="cuda").manual_seed(TOKENS)
    x = torch.randn(TOKENS, dim, generator=g, device="cuda").bfloat16()
    ids = torch.rand(TOKENS, experts, generator=g, device="cuda").topk(TOP_K, dim=-1).indices
    topk_weights = torch.rand(TOKENS, TOP_K, generator=g, device="cuda") + 0.25
    return (x, topk_weights, ids, *weights)


def run(args, group, tiles):
    return moe_experts.fp4_moe_experts_tiles(
        *args, swiglu_limit=LIMIT, act_quant_group=group, tiles=tiles
    )


def warm(model, name):
    """Compile one variant on 8 experts of the model's shapes (same specialisations)."""
    args = inputs_for(model, weights_for(model, experts=8))
    run(args, MODELS[model][3], VARIANTS[name])
    torch.cuda.synchronize()


def warm_all(parallel=32):
    jobs = [[sys.executable, __file__, "--warm", f"{m}:{n}"] for m in MODELS for n in VARIANTS]
    failed = []
    for start in range(0, len(jobs), parallel):
        procs = [
            subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
            for cmd in jobs[start : start + parallel]
        ]
        failed += [cmd[-1] for cmd, p in zip(jobs[start:], procs) if p.wait() != 0]
    print(f"compiled {len(jobs)} variants, failed: {failed}", flush=True)


def _timed(row, name, fn, nbytes):
    try:
        ms = time_graph(fn, iters=50)
    except Exception as e:  # one failing variant must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        return
    row[f"{name}_us"] = ms * 1e3
    if nbytes:
        row[f"{name}_TB/s"] = nbytes / ms / 1e9


def parts(row, model, args):
    """The launches around the expert GEMMs, each alone (graph replay)."""
    experts, dim, _, group = MODELS[model]
    x, _, ids = args[:3]
    _timed(row, "part_quantize_rows", lambda: quantize_rows(x, group), 0)
    _timed(row, "part_align_by_expert", lambda: moe_experts.align_by_expert(ids, experts, 16), 0)
    y = torch.randn(TOKENS * TOP_K, dim, device="cuda").bfloat16()
    out = torch.empty(TOKENS, dim, device="cuda")
    _timed(row, "part_combine", lambda: moe_experts._combine(y, out, TOP_K), 0)


def sweep(model):
    experts, _, _, group = MODELS[model]
    weights = weights_for(model)
    args = inputs_for(model, weights)
    used = torch.unique(args[2]).numel()
    nbytes = used * (sum(t.numel() for t in weights) // experts)
    row = {"model": model, "tokens": TOKENS, "experts_used": used, "GB_touched": nbytes / 1e9}
    want = OPS["fp4_moe_experts"].reference(*args, swiglu_limit=LIMIT, act_quant_group=group)
    spread = want.std()
    for name, tiles in VARIANTS.items():
        try:
            got = run(args, group, tiles)
            row[f"{name}_max_err"] = ((got - want).abs().max() / spread).item()
            row[f"{name}_mean_err"] = ((got - want).abs().mean() / spread).item()
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        _timed(row, name, lambda t=tiles: run(args, group, t), nbytes)
        print(f"{model:11s} {name:32s} {row.get(name + '_us', -1):9.1f} us "
              f"{row.get(name + '_TB/s', 0):5.2f} TB/s err max {row[name + '_max_err']:.2e} "
              f"mean {row[name + '_mean_err']:.2e}", flush=True)  # fmt: skip
    parts(row, model, args)
    for key in (k for k in row if k.startswith("part_") and k.endswith("_us")):
        print(f"{model:11s} {key:32s} {row[key]:9.1f} us", flush=True)
    for key in (k for k in row if k.endswith("_error")):
        print(f"{model:11s} {key}: {row[key]}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-warm", action="store_true")
    opts = parser.parse_args()
    if opts.warm:
        model, name = opts.warm.split(":")
        return warm(model, name)
    start = time.time()
    if not opts.no_warm:
        warm_all()
    print(f"warm {time.time() - start:.0f} s", flush=True)
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s", flush=True)
    rows = []
    for model in MODELS:
        rows.append(sweep(model))
        write_json(opts.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
        torch.cuda.empty_cache()
    print(f"total {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
