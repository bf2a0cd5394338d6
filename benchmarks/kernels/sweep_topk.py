"""Throwaway sweep (issue 8): where select_topk's time goes, and which launch of the v3 radix
select is fastest, at 64 rows x 16,384 scores, k = 512 (H200). Every full variant is checked
bit-for-bit against the reference first. Stages (``STAGE``) cut a kernel short after a phase
and store something that depends on it, so differences between stages time each phase.

    BENCH_COMMIT=<sha> python benchmarks/kernels/sweep_topk.py --out bench-out/sweep.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import environment, print_table, time_cuda, write_json  # noqa: E402

from deepinfer import kernels  # noqa: E402
from deepinfer.kernels_nvidia import backend  # noqa: E402
from deepinfer.kernels_nvidia.indexer_topk import (  # noqa: E402
    _kth_largest_key,
    _ordered_key,
    _rank_and_store,
)

ROWS, WIDTH, TOPK = 64, 16384, 512


@triton.jit
def _old_radix_digit(key, match, shift, want, NB: tl.constexpr):
    digit = ((key >> shift) & 255).to(tl.int32)
    hist = tl.histogram(tl.where(match, digit + NB, 0), 2 * NB)
    hist = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 1, tl.reshape(hist, [2, NB]), 0), axis=0)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    chosen = tl.sum((at_or_above >= want).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(tl.arange(0, NB) > chosen, hist, 0), axis=0)
    return chosen.to(tl.uint32), above


@triton.jit
def _old_kernel(
    scores_ptr, cand_ptr, out_ptr, scratch_ptr, num_cand, k,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, STAGE: tl.constexpr,
):  # fmt: skip
    """select_topk as of 2eb72d3 (4 x 8-bit radix, 512-bin masked histograms, sort)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * num_cand + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    want = tl.minimum(tl.sum((key > 0).to(tl.int32), axis=0), k)
    if STAGE == 0:
        tl.store(out_ptr + row * k, want.to(tl.int64))
        return
    prefix = tl.full([], 0, tl.uint32)
    match = key > 0
    rest = want
    for step in tl.static_range(4):
        digit, above = _old_radix_digit(key, match, 24 - 8 * step, rest, 256)
        rest -= above
        prefix = prefix | (digit << (24 - 8 * step))
        match = match & (((key >> (24 - 8 * step)) & 255) == digit)
    threshold = tl.where(want > 0, prefix, 4294967295)
    if STAGE == 1:
        tl.store(out_ptr + row * k, threshold.to(tl.int64))
        return
    win = key > threshold
    num_above = tl.sum(win.to(tl.int32), axis=0)
    tied = (key == threshold) & (key > 0)
    packed = ((key ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32) + (
        4294967295 - offs.to(tl.int64))  # fmt: skip
    scratch = scratch_ptr + row * BLOCK_K
    tl.store(scratch + tl.cumsum(win.to(tl.int32), axis=0) - 1, packed, mask=win)
    slot = num_above + tl.cumsum(tied.to(tl.int32), axis=0) - 1
    tl.store(scratch + slot, packed, mask=tied & (slot < want))
    tail = tl.arange(0, BLOCK_K)
    tl.store(scratch + tail, tl.full([BLOCK_K], -9223372036854775808, tl.int64), mask=tail >= want)
    if STAGE == 2:
        return
    tl.debug_barrier()
    ordered = tl.sort(tl.load(scratch + tail), 0, descending=True)
    column = (4294967295 - (ordered & 4294967295)).to(tl.int32)
    valid = tail < want
    picked = tl.load(cand_ptr + row * num_cand + column, mask=valid, other=-1).to(tl.int64)
    tl.store(out_ptr + row * k + tail, tl.where(valid, picked, -1), mask=tail < k)


@triton.jit
def _new_staged_kernel(
    scores_ptr, cand_ptr, out_ptr, scratch_ptr, num_cand, k,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr,
    RANK_SORT: tl.constexpr, STAGE: tl.constexpr,
):  # fmt: skip
    """The v3 kernel (indexer_topk._select_kernel) cut after a stage."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * num_cand + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    threshold = _kth_largest_key(key, num_valid, want, BLOCK_C, DIGIT)
    if STAGE == 1:
        tl.store(out_ptr + row * k, threshold.to(tl.int64))
        return
    win = key > threshold
    tied = (key == threshold) & (key > 0)
    slots = tl.cumsum(win.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
    num_above = tl.sum(win.to(tl.int32), axis=0)
    slot = tl.where(win, (slots & 65535) - 1, num_above + (slots >> 16) - 1)
    keep = win | (tied & (slot < want))
    packed = ((key ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32) + (
        4294967295 - offs.to(tl.int64))  # fmt: skip
    scratch = scratch_ptr + row * BLOCK_K
    tl.store(scratch + slot, packed, mask=keep)
    tail = tl.arange(0, BLOCK_K)
    tl.store(scratch + tail, tl.full([BLOCK_K], -9223372036854775808, tl.int64), mask=tail >= want)
    if STAGE == 2:
        return
    tl.debug_barrier()
    _rank_and_store(scratch, cand_ptr + row * num_cand, out_ptr + row * k, want, k,
                    BLOCK_K, 32, RANK_SORT)  # fmt: skip


def _inputs():
    """Real indexer scores (random bf16 queries and keys through the Triton scoring)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ROWS, 64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(ROWS, 64, device="cuda", generator=g) * (128 * 64) ** -0.5
    keys = torch.randn(WIDTH, 128, device="cuda", generator=g).bfloat16()
    cand = torch.arange(WIDTH, device="cuda", dtype=torch.int32).expand(ROWS, -1).contiguous()
    scores = backend.ops["indexer_scores"](q, w, keys, cand)
    return scores, cand


def _time(name, fn, rows, check=None):
    try:
        got = fn()
        ok = "" if check is None else ("ok" if torch.equal(got, check) else "WRONG")
        us = time_cuda(fn, iters=50) * 1e3
    except Exception as e:  # a variant that does not compile is reported, not fatal
        print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        rows.append({"variant": name, "us": float("nan"), "check": "failed"})
        return
    print(f"{name}: {us:.1f} us {ok}", flush=True)
    rows.append({"variant": name, "us": us, "check": ok})


def _new(scores, cand, out, scratch, stage, digit, rank, warps):
    def fn():
        _new_staged_kernel[(ROWS,)](scores, cand, out, scratch, WIDTH, TOPK, BLOCK_C=WIDTH,
                                    BLOCK_K=TOPK, DIGIT=digit, RANK_SORT=rank, STAGE=stage,
                                    num_warps=warps)  # fmt: skip
        return out

    return fn


def _old(scores, cand, out, scratch, stage, warps):
    def fn():
        _old_kernel[(ROWS,)](scores, cand, out, scratch, WIDTH, TOPK, BLOCK_C=WIDTH,
                             BLOCK_K=TOPK, STAGE=stage, num_warps=warps)  # fmt: skip
        return out

    return fn


def _select(scores, cand, **kw):
    return lambda: backend.ops["select_topk"](scores, cand, TOPK, **kw)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scores, cand = _inputs()
    ref = kernels.OPS["select_topk"].reference(scores, cand, TOPK)
    normal = torch.randn(ROWS, WIDTH, device="cuda")
    ref_normal = kernels.OPS["select_topk"].reference(normal, cand, TOPK)
    out = torch.empty(ROWS, TOPK, dtype=torch.int64, device="cuda")
    scratch = torch.empty(ROWS, TOPK, dtype=torch.int64, device="cuda")
    rows: list[dict] = []
    _time("select_topk default", _select(scores, cand), rows, ref)
    _time("select_topk default, randn scores", _select(normal, cand), rows, ref_normal)
    _time("torch.topk", lambda: scores.topk(TOPK, dim=-1), rows)
    variants = [(d, r, 16) for d in (4, 5, 6, 8) for r in (False, True)]
    variants += [(5, False, 8), (5, True, 8), (5, False, 4), (5, False, 32)]
    for digit, rank, warps in variants:
        name = f"select_topk d{digit} {'rank' if rank else 'sort'} w{warps}"
        _time(name, _select(scores, cand, digit=digit, rank_sort=rank, num_warps=warps), rows, ref)
    for stage, digit in [(1, 4), (1, 5), (1, 6), (2, 5)]:
        fn = _new(scores, cand, out, scratch, stage, digit, False, 16)
        _time(f"new stage{stage} d{digit} w16", fn, rows)
    for stage, warps in [(0, 16), (1, 16), (2, 16), (3, 16), (3, 8), (3, 32)]:
        fn = _old(scores, cand, out, scratch, stage, warps)
        _time(f"old stage{stage} w{warps}", fn, rows, ref if stage == 3 else None)
    print_table(rows, ["variant", "us", "check"])
    write_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
