"""Throwaway sweep (issue 7, MoE decode v5): the decode default against ``moe_split``'s
even/odd-split shapes (``bench_moe.SWEEP["decode"]``'s ``split-*``) at 64 tokens, V4-Flash and
V4.1-Flash, graph replay; each variant's error against the reference and the two expert GEMMs
timed alone (``gate_up`` / ``down``, each with its own bytes). Compiles every variant first in
parallel subprocesses (``bench_moe.py --warm``).

    python benchmarks/kernels/sweep_moe.py --out bench-out/sweep_moe.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402
from bench_moe import LIMIT, MODELS, inputs_for, weights_for  # noqa: E402
from common import copy_bandwidth_tbs, environment, time_graph, write_json  # noqa: E402

from deepinfer.kernels import OPS  # noqa: E402
from deepinfer.kernels_nvidia import moe_experts, moe_stream_launch  # noqa: E402
from deepinfer.kernels_nvidia.moe_split_gate_up import launch_fused_gate_up  # noqa: E402

TOKENS = 64


def _names():
    return ["default"] + [n for n in bench_moe.SWEEP["decode"] if "split" in n]


def _warm(names):
    jobs = [[sys.executable, bench_moe.__file__, "--warm", f"{m}:{TOKENS}:{n}"]
            for m in MODELS for n in names]  # fmt: skip
    procs = [subprocess.Popen(cmd) for cmd in jobs]
    failed = [cmd[-1] for cmd, p in zip(jobs, procs) if p.wait() != 0]
    print(f"compiled {len(jobs)}, failed: {failed}", flush=True)


def _gemms(row, name, args, group, tiles):
    """The variant's two expert GEMMs alone (graph replay) in TB/s of their own bytes."""
    x, topk_weights, ids, w13, s13, w2, s2 = args
    experts, top_k = w13.shape[0], ids.shape[1]
    layout = moe_experts.align_by_expert(ids, experts, tiles.block_m)
    act = moe_experts._round_trip_bf16(x, group)
    none = x.new_empty((1, 1), dtype=torch.float32)
    inter, dim = w13.shape[1] // 2, x.shape[1]
    upcast = moe_experts.STREAM_FAMILIES[tiles.mma]
    rows = (layout.row_slot, layout.block_expert)
    block_n = moe_experts._block_n(inter, tiles.block_n, group)
    if tiles.fused_gate_up:
        gate_up = lambda: launch_fused_gate_up(  # noqa: E731
            act, topk_weights, *rows, w13, s13, top_k=top_k, group=group, limit=LIMIT,
            tiles=tiles, block_n=block_n, on_cpu=False)  # fmt: skip
    else:
        gate_up = lambda: moe_stream_launch.launch_gate_up(  # noqa: E731
            act, none, topk_weights, *rows, w13, s13, top_k=top_k, group=group, limit=LIMIT,
            tiles=tiles, upcast=upcast, block_n=block_n, on_cpu=False)  # fmt: skip
    h, hs = gate_up()
    dt = tiles.down or tiles
    down = lambda: moe_stream_launch.launch_down(  # noqa: E731
        h, hs, *rows, w2, s2, num_slots=ids.numel(), group=group, tiles=dt,
        upcast=moe_experts.STREAM_FAMILIES[dt.mma],
        block_n=moe_experts._block_n(dim, dt.down_block_n or dt.block_n, None),
        on_cpu=False)  # fmt: skip
    used = torch.unique(ids).numel()
    for part, fn, nbytes in (("gate_up", gate_up, used * (w13[0].numel() + s13[0].numel())),
                             ("down", down, used * (w2[0].numel() + s2[0].numel()))):  # fmt: skip
        ms = time_graph(fn, iters=50)
        row[f"{name}_{part}_us"], row[f"{name}_{part}_TB/s"] = ms * 1e3, nbytes / ms / 1e9


def sweep(model, names):
    experts, _, _, group = MODELS[model]
    args = inputs_for(model, TOKENS, weights_for(model))
    used = torch.unique(args[2]).numel()
    nbytes = used * sum(t.numel() for t in args[3:]) // experts
    row = {"model": model, "tokens": TOKENS, "GB_touched": nbytes / 1e9}
    want = OPS["fp4_moe_experts"].reference(*args, swiglu_limit=LIMIT, act_quant_group=group)
    spread = want.std()
    for name in names:
        tiles = bench_moe.variants(model, TOKENS)[name] or bench_moe._default_tiles(model, TOKENS)
        try:
            got = bench_moe.run_ours(args, group, tiles)
            row[f"{name}_max_err"] = ((got - want).abs().max() / spread).item()
            ms = time_graph(lambda t=tiles: bench_moe.run_ours(args, group, t), iters=50)
            row[f"{name}_us"], row[f"{name}_TB/s"] = ms * 1e3, nbytes / ms / 1e9
            _gemms(row, name, args, group, tiles)
        except Exception as e:  # one failing variant must not hide the others
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        print(f"{model} {name:28s} {row.get(f'{name}_us', -1):8.1f} us "
              f"{row.get(f'{name}_TB/s', 0):5.2f} TB/s  gate_up {row.get(f'{name}_gate_up_us', -1):7.1f}"
              f"  down {row.get(f'{name}_down_us', -1):7.1f}  err {row.get(f'{name}_max_err', -1):.4f}"
              f"  {row.get(f'{name}_error', '')}", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-warm", action="store_true")
    opts = parser.parse_args()
    names = _names()
    if not opts.no_warm:
        _warm(names)
    ceiling = copy_bandwidth_tbs()
    print(f"copy {ceiling:.2f} TB/s", flush=True)
    rows = []
    for model in MODELS:
        rows.append(sweep(model, names))
        write_json(opts.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
