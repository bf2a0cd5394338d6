"""Throwaway sweep (issue 7, MoE prefill, HD): (1) the expert permutation for decode-sized
batches: the one-program ``moe_align.align_small`` against the multi-program
``moe_align.align_multi`` and the torch composition (graph replay); (2) the launches of the
prefill default alone at 8,192 tokens (V4-Flash and V4.1-Flash): permutation (the torch
composition and the chunked ``moe_align.align_large``), input round trip, gate/up GEMM, down
GEMM and combine, each GEMM with its effective TFLOP/s.

    python benchmarks/kernels/sweep_moe.py --out bench-out/sweep_moe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import LIMIT, MODELS, TOP_K, inputs_for, weights_for  # noqa: E402
from common import environment, time_cuda, time_graph, write_json  # noqa: E402

from deepinfer.kernels_nvidia import moe_align, moe_experts, moe_stream_launch  # noqa: E402

ALIGN_SHAPES = [(64, 256), (64, 384), (256, 256), (341, 384), (1, 256)]  # (tokens, experts)


def _timed(row, name, fn, *, graph, flops=0):
    try:
        ms = time_graph(fn, iters=50) if graph else time_cuda(fn, warmup=2, iters=10)
    except Exception as e:  # one failing part must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        return
    row[f"{name}_us"] = ms * 1e3
    if flops:
        row[f"{name}_TFLOP/s"] = flops / ms / 1e9


def align_rows():
    return [_align_row(tokens, experts) for tokens, experts in ALIGN_SHAPES]


def _align_row(tokens, experts):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(TOP_K, -1).indices
    flat = ids.reshape(-1).contiguous()
    block_m = moe_experts.DECODE_TILES.block_m
    cap = moe_experts.align_by_expert(ids, experts, block_m).row_slot.numel()
    row = {"tokens": tokens, "experts": experts, "slots": flat.numel()}
    want = moe_experts._align_by_expert_torch(flat.long(), experts, block_m, cap)
    got = moe_align.align_multi(flat, experts, block_m, cap)
    row["multi_equal"] = bool(
        torch.equal(got[0], want.row_slot) and torch.equal(got[1], want.block_expert)
    )
    _timed(row, "one_program", lambda: moe_align.align_small(flat, experts, block_m, cap),
           graph=True)  # fmt: skip
    for chunk in (32, 64, 128):
        fn = lambda c=chunk: moe_align.align_multi(flat, experts, block_m, cap, c)  # noqa: E731
        _timed(row, f"multi_c{chunk}", fn, graph=True)
    fn = lambda: moe_experts._align_by_expert_torch(flat.long(), experts, block_m, cap)  # noqa: E731
    _timed(row, "torch", fn, graph=True)
    print(row, flush=True)
    return row


def prefill_parts(model, tokens=8192):
    experts, dim, inter, group = MODELS[model]
    args = inputs_for(model, tokens, weights_for(model))
    x, topk_weights, ids, w13, s13, w2, s2 = args
    tiles = moe_experts.choose_tiles(ids.numel(), experts, batch_invariant=False, on_cpu=False)
    row = {"model": model, "tokens": tokens, "tiles": str(tiles)}
    layout = moe_experts.align_by_expert(ids, experts, tiles.block_m)
    real = ids.numel()
    row["padded_rows"] = int((layout.block_expert >= 0).sum()) * tiles.block_m
    row["row_efficiency"] = real / row["padded_rows"]
    act = moe_experts._round_trip_bf16(x, group)
    none_scale = x.new_empty((1, 1), dtype=torch.float32)
    gu_kw = dict(top_k=TOP_K, group=group, limit=LIMIT, tiles=tiles, upcast="mx",
                 block_n=moe_experts._block_n(inter, tiles.block_n, group), on_cpu=False)  # fmt: skip

    def gate_up():
        return moe_stream_launch.launch_gate_up(act, none_scale, topk_weights, layout.row_slot,
                                         layout.block_expert, w13, s13, **gu_kw)  # fmt: skip

    h, hs = gate_up()
    dn_block = moe_experts._block_n(dim, tiles.down_block_n or tiles.block_n, None)

    def down():
        return moe_stream_launch.launch_down(h, hs, layout.row_slot, layout.block_expert, w2, s2,
                                      num_slots=real, group=group, tiles=tiles, upcast="mx",
                                      block_n=dn_block, on_cpu=False)  # fmt: skip

    y = down()
    out = torch.empty((tokens, dim), dtype=torch.float32, device="cuda")
    _timed(row, "align", lambda: moe_experts.align_by_expert(ids, experts, tiles.block_m),
           graph=False)  # fmt: skip
    flat, cap = ids.reshape(-1), layout.row_slot.numel()
    got = moe_align.align_large(flat, experts, tiles.block_m, cap)
    row["align_large_equal"] = bool(
        torch.equal(got[0], layout.row_slot) and torch.equal(got[1], layout.block_expert)
    )
    _timed(row, "align_large", lambda: moe_align.align_large(flat, experts, tiles.block_m, cap),
           graph=False)  # fmt: skip
    _timed(row, "round_trip", lambda: moe_experts._round_trip_bf16(x, group), graph=False)
    _timed(row, "gate_up", gate_up, graph=False, flops=4 * real * dim * inter)
    _timed(row, "down", down, graph=False, flops=2 * real * dim * inter)
    _timed(row, "combine", lambda: moe_experts._combine(y, out, TOP_K), graph=False)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    result = {"env": environment(), "align": align_rows(), "prefill_parts": []}
    write_json(opts.out, result)
    for model in MODELS:
        result["prefill_parts"].append(prefill_parts(model))
        write_json(opts.out, result)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
