"""Launch-shape sweep on one GPU: mHC post/pre launch shapes, indexer scoring + top-k launch
shapes, prefill sparse attention tiles (both whole-list kernels).
Prints a line per variant and writes JSON after each section.

    python -m benchmarks.kernels.sweep_launch_shapes {indexer,hc,attn} --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import environment, time_cuda
from deepinfer import kernels
from deepinfer.kernels_nvidia import backend
from deepinfer.kernels_nvidia.attention import AttentionTiles
from deepinfer.kernels_nvidia.hc_pre import HcPreTiles, hc_pre

ROWS: list[dict] = []


def record(section: str, variant: str, us: float, **extra) -> None:
    ROWS.append({"section": section, "variant": variant, "us": us, **extra})
    more = " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(f"{section:8s} {variant:40s} {us:9.1f} us  {more}", flush=True)


def attempt(section, variant, fn, nbytes=None, flops=None, iters=30):
    try:
        ms = time_cuda(fn, iters=iters, warmup=3)
    except Exception as e:  # a launch shape that does not compile is reported, not fatal
        print(f"{section} {variant} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    extra = {}
    if nbytes:
        extra["TB/s"] = nbytes / ms / 1e9
    if flops:
        extra["TFLOP/s"] = flops / ms / 1e9
    record(section, variant, ms * 1e3, **extra)
    return ms


def sweep_indexer() -> None:
    rows, heads, dim, entries, k = 64, 64, 128, 16384, 512
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(rows, heads, device="cuda") * (dim * heads) ** -0.5
    keys = torch.randn(entries, dim, device="cuda").bfloat16()
    # every row reads all of one sequence's entries
    seq_rows = torch.arange(entries, device="cuda", dtype=torch.int32)[None]
    q_seq = torch.zeros(rows, dtype=torch.long, device="cuda")
    cand = (seq_rows, q_seq, torch.full((rows,), entries, device="cuda"))
    nbytes = rows * entries * dim * 2
    score = backend.ops["indexer_scores"]
    topk = backend.ops["select_topk"]
    ref_scores = kernels.OPS["indexer_scores"].reference(q, w, keys, *cand)
    best = None
    for bc, nb, nw in [(64, 1, 4), (64, 4, 4), (64, 16, 4), (128, 4, 8), (128, 8, 8),
                       (128, 4, 4), (32, 8, 4)]:  # fmt: skip
        kw = {"block_c": bc, "blocks_per_program": nb, "num_warps": nw}
        got = score(q, w, keys, *cand, **kw)
        err = (got - ref_scores).abs().max().item()
        ms = attempt(
            "indexer",
            f"scores bc{bc} nb{nb} w{nw}",
            lambda kw=kw: score(q, w, keys, *cand, **kw),
            nbytes,
        )
        record("indexer", f"  err bc{bc} nb{nb} w{nw}", 0.0, max_err=err)
        if ms and (best is None or ms < best[0]):
            best = (ms, kw)
    scores = score(q, w, keys, *cand, **best[1])
    lists = (seq_rows, q_seq)
    same = torch.equal(
        topk(scores, *lists, k), kernels.OPS["select_topk"].reference(scores, *lists, k)
    )
    attempt("indexer", f"topk (exact={same})", lambda: topk(scores, *lists, k))
    attempt("indexer", "torch.topk", lambda: scores.topk(k, dim=-1))
    kw = best[1]
    attempt(
        "indexer",
        f"scores+topk best {kw}",
        lambda: topk(score(q, w, keys, *cand, **kw), *lists, k),
        nbytes,
    )
    keys8 = keys.to(torch.float8_e4m3fn)
    attempt("indexer", f"scores+topk fp8 keys {kw}",
            lambda: topk(score(q, w, keys8, *cand, **kw), *lists, k), nbytes // 2)  # fmt: skip


def _hc_case(dim: int, tokens: int) -> None:
    kw = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
    ops = backend.ops
    h = torch.randn(tokens, 4, dim, device="cuda", dtype=torch.bfloat16)
    f = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn(24, 4 * dim, device="cuda") * (4 * dim) ** -0.5
    base = torch.randn(24, device="cuda")
    scale = torch.rand(3, device="cuda") + 0.5
    pre, post, comb = ops["hc_mix_coefficients"](h, fn, base, scale, **kw)
    tag = f"D{dim} T{tokens}"
    if tokens > 64:
        for bd, nw in [(512, 4), (1024, 4), (1024, 8), (2048, 8)]:
            attempt("hc", f"post {tag} bd{bd} w{nw}",
                    lambda bd=bd, nw=nw: ops["hc_expand"](f, h, post, comb, block_d=bd, num_warps=nw),
                    tokens * 9 * dim * 2)  # fmt: skip
    attempt("hc", f"pre two-op {tag}",
            lambda: ops["hc_collapse"](h, ops["hc_mix_coefficients"](h, fn, base, scale, **kw)[0]),
            tokens * 5 * dim * 2, iters=10)  # fmt: skip
    y, p2, po2, c2 = hc_pre(h, fn, base, scale, **kw)
    errs = [(a - b).abs().max().item() for a, b in ((p2, pre), (po2, post), (c2, comb))]
    yerr = (y.float() - ops["hc_collapse"](h, p2).float()).abs().max().item()
    record("hc", f"  fused pre err {tag}", 0.0, coeff_err=max(errs), y_err=yerr)
    for bt, dc, nw in [(16, 128, 4), (16, 64, 4), (32, 64, 4), (32, 128, 8), (16, 256, 8)]:
        tiles = HcPreTiles(bt, dc, nw)
        attempt("hc", f"pre fused {tag} bt{bt} dc{dc} w{nw}",
                lambda t=tiles: hc_pre(h, fn, base, scale, tiles=t, **kw),
                tokens * 5 * dim * 2)  # fmt: skip


def sweep_hc() -> None:
    for dim, tokens in ((4096, 16384), (4096, 64), (5120, 16384)):
        _hc_case(dim, tokens)


def sweep_attn() -> None:
    rows, heads, dim, window, entries, arena = 8192, 64, 512, 128, 512, 131072
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(arena + window * 4, dim, device="cuda", generator=g).bfloat16()
    win = torch.randint(arena, arena + window * 4, (rows, window), device="cuda", generator=g)
    comp = torch.randint(0, arena, (rows, entries), device="cuda", generator=g)
    idx = torch.cat([win, comp], 1).int()
    sink = torch.randn(heads, device="cuda", generator=g)
    flops = 4 * rows * heads * (window + entries) * dim
    fn = backend.ops["sparse_mqa_sink"]
    ref = None
    for tiles in [
        AttentionTiles(block_n=64, num_stages=3, split_rows_max=0),
        AttentionTiles(block_n=32, num_stages=3, split_rows_max=0),
        AttentionTiles(block_n=64, num_stages=2, num_warps=16, split_rows_max=0),
        AttentionTiles(block_n=32, num_stages=2, split_rows_max=0, halves=True),
        AttentionTiles(block_n=32, num_stages=3, split_rows_max=0, halves=True),
        AttentionTiles(block_n=64, num_stages=2, split_rows_max=0, halves=True),
        AttentionTiles(block_n=64, num_stages=2, num_warps=16, split_rows_max=0, halves=True),
    ]:
        name = f"{'halves' if tiles.halves else 'whole'} bn{tiles.block_n} s{tiles.num_stages} w{tiles.num_warps}"
        try:
            out = fn(q, kv, idx, sink, dim**-0.5, tiles=tiles)
        except Exception as e:
            print(f"attn {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if ref is None:
            ref = out
        err = (out.float() - ref.float()).abs().max().item()
        attempt("attn", f"{name} err={err:.3g}",
                lambda t=tiles: fn(q, kv, idx, sink, dim**-0.5, tiles=t), flops=flops, iters=8)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=["indexer", "hc", "attn"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    try:
        {"indexer": sweep_indexer, "hc": sweep_hc, "attn": sweep_attn}[args.section]()
    finally:
        path = Path(args.out) / f"sweep-{args.section}.json"
        path.write_text(json.dumps({"env": environment(), "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
