"""Routed experts (FP4 weights) on the GPU at V4-Flash (256 experts, top-6, hidden 4096, inter
2048, act group 128) and V4.1-Flash (384 experts, hidden 5120, inter 2304, group 32) shapes, for a
decode batch (64 tokens) and a prefill batch (8,192 tokens), in one run:

- ours: the default tiles (``choose_tiles``), the batch-invariant tiles and a sweep of variants:
  the bf16 family's tiles (``old_default`` for a middle / prefill batch and
  ``old-default-bf16-16x64`` for decode), the stream families' tile shapes (``SWEEP``); decode
  also times the launches around the expert GEMMs alone (``part_*``: permutation, input round
  trip / quantisation, combine, each GEMM) and replays from a CUDA graph (the kernels' rate
  without the host's launch cost);
- the best torch built-in compositions: ``torch_fp4`` dequantises the experts the batch uses to
  bf16 and runs ``torch._grouped_mm``; ``torch_bf16`` does the same on experts dequantised ahead
  of time (not possible for the whole model: 277 B parameters; an upper bound for torch);
- the reference (decode: 3 runs; larger batches: one run after one warm-up).

Effective TFLOP/s counts ``6 * T * k * D * I`` (the padding rows of each expert's last block not
counted). TB/s counts the FP4 expert bytes touched (packed weights + scales of every expert used
at least once). Errors: max and mean of |ours - reference| over the output's standard deviation.
Every tile shape is compiled first in parallel subprocesses (``--warm-only`` does only that),
then timed one after another.

    python -m benchmarks.kernels.bench_moe --out bench-out/moe.json
    python -m benchmarks.kernels.bench_moe --tokens 512,2048,8192 --out bench-out/moe-prefill.json
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import torch

from benchmarks.common import (
    copy_bandwidth_tbs,
    environment,
    print_table,
    time_cuda,
    time_graph,
    write_json,
)
from benchmarks.kernels.moe_baselines import dequant_bf16, torch_moe, torch_moe_from_fp4
from deepinfer.kernels import OPS
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia.moe import align, stream
from deepinfer.kernels_nvidia.moe import experts as moe_experts
from deepinfer.kernels_nvidia.moe.experts import MoeTiles
from deepinfer.kernels_nvidia.moe.split import launch_fused_gate_up
from deepinfer.kernels_nvidia.quant import quantize_rows

MODELS = {"V4-Flash": (256, 4096, 2048, 128), "V4.1-Flash": (384, 5120, 2304, 32)}
TOP_K, LIMIT = 6, 10.0
BF16_CEILING_TFLOPS = 786  # measured bf16 tensor-core rate on the H200 (toolchain.md)


# The bf16 family's tiles: the defaults before the stream kernels, timed for comparison.
BF16_TILES = {"decode": MoeTiles(16, 64, 4, 4), "middle": MoeTiles(64, 128, 4, 3),
              "prefill": MoeTiles(128, 128, 8, 2)}  # fmt: skip


def _mx(block_m, block_k, warps, stages, group_m=4, wgmma_fence=False):
    return MoeTiles(block_m, 128, warps, stages, mma="mx", block_k=block_k, group_m=group_m,
                    wgmma_fence=wgmma_fence)  # fmt: skip


def _split(block_n, block_k, warps, stages, fused=False):
    tiles = MoeTiles(16, block_n, warps, stages, mma="split", swap_ab=True, block_k=block_k,
                     group_m=0, wgmma_fence=True, fused_gate_up=fused)  # fmt: skip
    return dataclasses.replace(tiles, down=moe_experts.SPLIT_DOWN_TILES) if fused else tiles


SWEEP = {
    "decode": {
        "old-default-bf16-16x64": BF16_TILES["decode"],
        # tl.dot_scaled's upcast for both GEMMs, fenced (the decode default before the split)
        "mx-v4-default": MoeTiles(16, 128, 8, 3, mma="mx", block_k=256, group_m=0,
                                  wgmma_fence=True),
        # the split family's even/odd upcast for both GEMMs (gate and up as two weight tiles)
        "split-n128-k128-w4s4": _split(128, 128, 4, 4),
        "split-n128-k128-w8s4": _split(128, 128, 8, 4),
        # gate and up rows in one weight tile (the split family's fused gate/up), the default's
        # split down
        "split-fused-n128-k128-w8s3": _split(128, 128, 8, 3, fused=True),
        "split-fused-n128-k64-w4s4": _split(128, 64, 4, 4, fused=True),
        # block_n a multiple of the group: 128 for V4-Flash (then 4 warps on 256 weight rows)
        "split-fused-n64-k128-w4s4": _split(64, 128, 4, 4, fused=True),
        # the default's "mx" gate/up with a narrower split down (more programs per SM)
        "mx-then-split-down-n64": dataclasses.replace(
            moe_experts.DECODE_TILES, down=_split(64, 128, 4, 4)),
    },
    # stream shapes whose machine code waits for every wgmma ("-fence": made so by
    # MoeTiles.wgmma_fence); the default of each regime is timed as "default"
    "middle": {
        "mx-32-k128-w8s4": _mx(32, 128, 8, 4),
        "mx-64-k128-w8s3": _mx(64, 128, 8, 3),
    },
    "prefill": {
        "mx-64-k128-w8s3": _mx(64, 128, 8, 3),
        "mx-128-k64-w8s4-fence": _mx(128, 64, 8, 4, wgmma_fence=True),
    },
}  # fmt: skip
# the sweep's models per phase (the others: default and batch-invariant tiles only)
SWEEP_MODELS = {"decode": tuple(MODELS), "middle": ("V4-Flash",), "prefill": tuple(MODELS)}


def weights_for(model, num_experts=None):
    experts, dim, inter, _ = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(experts)
    experts = num_experts or experts
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), "cuda")
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), "cuda")
    return w13, s13, w2, s2


def inputs_for(model, tokens, weights):
    experts, dim = weights[0].shape[0], MODELS[model][1]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=g, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(TOP_K, dim=-1).indices
    topk_weights = torch.rand(tokens, TOP_K, generator=g, device="cuda") + 0.25
    return (x, topk_weights, ids, *weights)


def variants(model, tokens):
    """name -> tiles (None: choose_tiles's default) for this model and batch."""
    experts = MODELS[model][0]
    phase = _phase(tokens, experts)
    bi = moe_experts.choose_tiles(tokens * TOP_K, experts, batch_invariant=True, on_cpu=False)
    out = {"default": None, "batch_invariant": bi}
    if phase != "decode":  # the bf16 family's tiles, the default here before
        out["old_default"] = BF16_TILES[phase]
    if model in SWEEP_MODELS[phase]:
        out.update(SWEEP[phase])
    return out


def _phase(tokens, experts):
    if tokens <= 256:
        return "decode"
    return "middle" if tokens * TOP_K / experts <= 96 else "prefill"


def run_ours(args, group, tiles):
    return moe_experts.fp4_moe_experts_tiles(
        *args, swiglu_limit=LIMIT, act_quant_group=group, tiles=tiles
    )


def _time(row, name, fn, flops, nbytes, *, iters=20, warmup=2, graph=False):
    try:
        ms = time_graph(fn, iters=iters) if graph else time_cuda(fn, warmup=warmup, iters=iters)
    except Exception as e:  # one failing variant must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        return
    row[f"{name}_us"] = ms * 1e3
    row[f"{name}_TFLOP/s"] = flops / ms / 1e9
    row[f"{name}_TB/s"] = nbytes / ms / 1e9


def _errors(row, name, got, want):
    spread = want.std()
    row[f"{name}_max_err"] = ((got - want).abs().max() / spread).item()
    row[f"{name}_mean_err"] = ((got - want).abs().mean() / spread).item()


def bench(model, tokens, weights, torch_bf16_weights):
    experts, dim, inter, group = MODELS[model]
    args = inputs_for(model, tokens, weights)
    used = torch.unique(args[2]).numel()
    per_expert = sum(t.numel() for t in weights) // experts
    flops, nbytes = 6 * tokens * TOP_K * dim * inter, used * per_expert
    row = {"model": model, "tokens": tokens, "experts_used": used, "GB_touched": nbytes / 1e9}
    reference = OPS["fp4_moe_experts"].reference
    want = reference(*args, swiglu_limit=LIMIT, act_quant_group=group)
    for name, tiles in variants(model, tokens).items():
        try:
            _errors(row, name, run_ours(args, group, tiles), want)
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        fn = lambda t=tiles: run_ours(args, group, t)  # noqa: E731
        _time(row, name, fn, flops, nbytes, iters=20 if tokens <= 2048 else 10)
        if tokens <= 256:
            _time(row, f"{name}_graph", fn, flops, nbytes, iters=50, graph=True)
    _time(row, "torch_fp4", lambda: torch_moe_from_fp4(*args, limit=LIMIT), flops, nbytes, iters=5)
    if torch_bf16_weights is not None:
        pre = lambda: torch_moe(*args[:3], *torch_bf16_weights, limit=LIMIT)  # noqa: E731
        _time(row, "torch_bf16", pre, flops, nbytes)
    kw = dict(swiglu_limit=LIMIT, act_quant_group=group)
    runs = dict(iters=3) if tokens <= 256 else dict(iters=1, warmup=1)
    _time(row, "reference", lambda: reference(*args, **kw), flops, nbytes, **runs)
    if tokens <= 256:
        _parts(row, model, args)
    _speedups(row, tokens)
    return row


def _parts(row, model, args):
    """The launches around the expert GEMMs alone (graph replay), for a decode batch: the
    permutation (one launch vs the torch composition), the input's FP8 round trip to bf16 (the
    "mx" kernels' input), its e4m3 quantisation (the other families') and the combine."""
    experts, dim, _, group = MODELS[model]
    x, _, ids = args[:3]
    tokens, top_k = ids.shape
    block_m = moe_experts.DECODE_TILES.block_m
    flat = ids.reshape(-1)
    capacity = tokens * top_k + min(experts, tokens * top_k) * (block_m - 1) + block_m - 1
    capacity = capacity // block_m * block_m
    y = torch.randn(tokens * top_k, dim, device="cuda").bfloat16()
    out = torch.empty(tokens, dim, device="cuda")
    parts = {
        "part_align_one_launch": lambda: align.align_by_expert(ids, experts, block_m),
        "part_align_torch": lambda: align._align_by_expert_torch(
            flat.long(), experts, block_m, capacity
        ),
        "part_fp8_round_trip_bf16": lambda: moe_experts.round_trip_bf16(x, group),
        "part_quantize_rows": lambda: quantize_rows(x, group),
        "part_combine": lambda: moe_experts._combine(y, out, top_k),
    }
    for name, fn in parts.items():
        _time(row, name, fn, 0, 0, iters=50, graph=True)
    _gemm_parts(row, args, group, experts)


def _gemm_parts(row, args, group, experts):
    """The decode default's two expert GEMMs alone (graph replay), each with its own bytes."""
    x, topk_weights, ids, w13, s13, w2, s2 = args
    tiles = moe_experts.choose_tiles(ids.numel(), experts, batch_invariant=False, on_cpu=False,
                                     act_quant_group=group)  # fmt: skip
    layout = align.align_by_expert(ids, experts, tiles.block_m)
    act = moe_experts.round_trip_bf16(x, group)
    rows = (layout.row_slot, layout.block_expert)
    inter, dim = w13.shape[1] // 2, x.shape[1]
    used = torch.unique(ids).numel()
    launch = launch_fused_gate_up if tiles.fused_gate_up else stream.launch_gate_up
    gate_up = lambda: launch(  # noqa: E731
        act, topk_weights, *rows, w13, s13, top_k=ids.shape[1], group=group, limit=LIMIT,
        tiles=tiles, block_n=moe_experts.block_n_for(inter, tiles.block_n, group), on_cpu=False,
    )  # fmt: skip
    try:
        h = gate_up()
    except Exception as e:  # recorded, like a failing variant
        row["part_gate_up_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        return
    dt = tiles.down or tiles
    down = lambda: stream.launch_down(  # noqa: E731
        h, *rows, w2, s2, num_slots=ids.numel(), group=group, tiles=dt, on_cpu=False,
        block_n=moe_experts.block_n_for(dim, dt.down_block_n or dt.block_n, None),
    )  # fmt: skip
    gate_up_bytes = used * (w13[0].numel() + s13[0].numel())
    down_bytes = used * (w2[0].numel() + s2[0].numel())
    _time(row, "part_gate_up", gate_up, 0, gate_up_bytes, iters=50, graph=True)
    _time(row, "part_down", down, 0, down_bytes, iters=50, graph=True)


def _speedups(row, tokens):
    mine = [
        k for k in row if k.endswith("_us") and not k.startswith(("torch", "reference", "part"))
    ]
    mine = [k for k in mine if "graph" not in k] if tokens > 256 else mine
    if not mine:
        return
    best = min(mine, key=row.get)
    row["best"], row["best_us"] = best.removesuffix("_us"), row[best]
    for base in ("torch_fp4", "torch_bf16"):
        if f"{base}_us" in row and "default_us" in row:
            row[f"default_speedup_vs_{base}"] = row[f"{base}_us"] / row["default_us"]
            row[f"best_speedup_vs_{base}"] = row[f"{base}_us"] / row["best_us"]


def warm(model, tokens, name):
    """Compile one variant (run in a subprocess; the Triton cache is shared) on 8 experts of the
    model's shapes: the same specialisations as the whole layer."""
    tiles = variants(model, tokens)[name] or _default_tiles(model, tokens)
    weights = weights_for(model, num_experts=8)
    run_ours(inputs_for(model, min(tokens, 512), weights), MODELS[model][3], tiles)
    torch.cuda.synchronize()


def _default_tiles(model, tokens):
    experts, group = MODELS[model][0], MODELS[model][3]
    return moe_experts.choose_tiles(tokens * TOP_K, experts, batch_invariant=False, on_cpu=False,
                                    act_quant_group=group)  # fmt: skip


def warm_all(token_counts, parallel=32):
    """Compile each (model, tile shape) once, in parallel subprocesses."""
    seen, jobs = set(), []
    for m in MODELS:
        for t in token_counts:
            for n, tiles in variants(m, t).items():
                key = (m, tiles or _default_tiles(m, t))
                if key not in seen:
                    seen.add(key)
                    jobs.append(
                        [
                            sys.executable,
                            "-m",
                            "benchmarks.kernels.bench_moe",
                            "--warm",
                            f"{m}:{t}:{n}",
                        ]
                    )
    failed = []
    for start in range(0, len(jobs), parallel):
        procs = [subprocess.Popen(cmd) for cmd in jobs[start : start + parallel]]
        failed += [cmd[-1] for cmd, p in zip(jobs[start:], procs) if p.wait() != 0]
    print(f"compiled {len(jobs)} variants, failed: {failed}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="64,8192")
    parser.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warm-only", action="store_true", help="compile every variant, exit")
    parser.add_argument("--no-warm", action="store_true", help="skip the parallel compile")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs an NVIDIA GPU")
    if opts.warm:
        model, tokens, name = opts.warm.split(":")
        return warm(model, int(tokens), name)
    token_counts = [int(t) for t in opts.tokens.split(",")]
    if not opts.no_warm:
        warm_all(token_counts)
    if opts.warm_only:
        return
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s", flush=True)
    rows = []
    for model in MODELS:
        weights = weights_for(model)
        w13, s13, w2, s2 = weights
        pre = (dequant_bf16(w13, s13), dequant_bf16(w2, s2))
        for tokens in token_counts:
            rows.append(bench(model, tokens, weights, pre))
            write_json(opts.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
            _print_row(rows[-1])
        del weights, pre
        torch.cuda.empty_cache()
    cols = ["model", "tokens", "default_us", "default_TFLOP/s", "default_TB/s", "default_graph_us",
            "default_graph_TB/s", "batch_invariant_us", "best", "best_us", "torch_fp4_us",
            "torch_bf16_us", "default_speedup_vs_torch_fp4", "default_speedup_vs_torch_bf16",
            "default_max_err", "default_mean_err"]  # fmt: skip
    print_table(rows, cols)
    decode = [r for r in rows if r["tokens"] <= 256]
    if decode:
        print("decode (TB/s of FP4 expert bytes touched; copy ceiling "
              f"{ceiling:.2f} TB/s):")  # fmt: skip
        print_table(decode, ["model", "tokens", "GB_touched", "default_graph_us",
                             "default_graph_TB/s", "default_TB/s", "mx-v4-default_graph_us",
                             "mx-v4-default_graph_TB/s", "best", "best_us",
                             "old-default-bf16-16x64_graph_us", "old-default-bf16-16x64_graph_TB/s",
                             "torch_fp4_TB/s", "torch_bf16_TB/s", "reference_TB/s",
                             "part_align_one_launch_us", "part_align_torch_us",
                             "part_fp8_round_trip_bf16_us", "part_combine_us",
                             "part_gate_up_us", "part_gate_up_TB/s", "part_down_us",
                             "part_down_TB/s"])  # fmt: skip
    larger = [r for r in rows if r["tokens"] > 256]
    if larger:
        print(f"middle / prefill (effective TFLOP/s; bf16 ceiling {BF16_CEILING_TFLOPS}):")
        print_table(larger, ["model", "tokens", "default_us", "default_TFLOP/s", "old_default_us",
                             "old_default_TFLOP/s", "best", "best_us", "torch_fp4_TFLOP/s",
                             "torch_bf16_TFLOP/s", "reference_TFLOP/s",
                             "default_speedup_vs_torch_fp4", "default_speedup_vs_torch_bf16",
                             "default_max_err", "default_mean_err"])  # fmt: skip
    print("ceilings: copy", f"{ceiling:.2f} TB/s; FP8 _scaled_mm 1,449 TFLOP/s; bf16",
          f"{BF16_CEILING_TFLOPS} TFLOP/s")  # fmt: skip


def _print_row(row):
    print(f"--- {row['model']} T={row['tokens']} experts used {row['experts_used']}", flush=True)
    for key in sorted(k for k in row if k.endswith("_us") and k != "best_us"):
        name = key.removesuffix("_us")
        err = row.get(f"{name}_max_err")
        err_text = f"  err max {err:.4f} mean {row[f'{name}_mean_err']:.5f}" if err else ""
        print(f"  {name:32s} {row[key]:10.1f} us  {row.get(name + '_TFLOP/s', 0):7.1f} TFLOP/s"
              f"  {row.get(name + '_TB/s', 0):5.2f} TB/s{err_text}", flush=True)  # fmt: skip
    for key in sorted(k for k in row if k.endswith("_error")):
        print(f"  {key}: {row[key]}", flush=True)


if __name__ == "__main__":
    main()
