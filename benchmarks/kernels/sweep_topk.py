"""Throwaway sweep (issue 8): select_topk v5 launch variants against v3 (the first call's
best: 16,384-long prefix sum for the winners, no compaction) at 64 rows x 16,384 scores,
k = 512 (H200), each checked bit for bit against the reference before it is timed.

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
from deepinfer.kernels_nvidia.indexer_select import _ordered_key  # noqa: E402

ROWS, WIDTH, TOPK = 64, 16384, 512


@triton.jit
def _v3_kth_largest_key(key, match_count, want, BLOCK_C: tl.constexpr, DIGIT: tl.constexpr):
    """The ``want``-th largest of the ``key`` values that are > 0 (``match_count`` of them;
    ``want >= 1``), by a radix select over ``DIGIT``-bit digits, most significant first, that
    stops as soon as every key sharing the chosen prefix is needed.

    Keys outside the prefix (and the zeros) all land in bin 0 of each ``2**DIGIT``-bin
    histogram; the known number of them is taken back out, so no histogram needs a mask."""
    NB: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NB)
    match = key > 0
    rest = want
    shift = tl.full([], 32 - DIGIT, tl.int32)
    found = match_count == want
    while (shift >= 0) & (found == 0):
        digit = ((key >> shift.to(tl.uint32)) & (NB - 1)).to(tl.int32)
        hist = tl.histogram(tl.where(match, digit, 0), NB)
        hist -= tl.where(bins == 0, BLOCK_C - match_count, 0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count(d >= b)
        chosen = tl.sum((at_or_above >= rest).to(tl.int32), axis=0) - 1
        in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
        rest -= tl.sum(tl.where(bins == chosen, at_or_above, 0), axis=0) - in_bin
        match = match & (digit == chosen)
        match_count = in_bin
        found = in_bin == rest  # every key left with this prefix is a winner
        shift = tl.where(shift == 0, -1, tl.maximum(shift - DIGIT, 0))
    return tl.min(tl.where(match, key, 4294967295), axis=0)


@triton.jit
def _v3_rank_and_store(scratch, cand_row, out_row, want, k, BLOCK_K: tl.constexpr,
                    RANK_CHUNK: tl.constexpr, RANK_SORT: tl.constexpr):  # fmt: skip
    """Order the ``want`` packed winners in ``scratch[:BLOCK_K]`` (the rest hold the smallest
    int64) descending and write their candidates, ``-1`` from ``want`` up to ``k``."""
    tail = tl.arange(0, BLOCK_K)
    packed = tl.load(scratch + tail)
    if RANK_SORT:  # each winner's place = how many packed values exceed its own (all distinct)
        rank = tl.zeros([BLOCK_K], tl.int32)
        for j0 in range(0, BLOCK_K, RANK_CHUNK):
            other = tl.load(scratch + j0 + tl.arange(0, RANK_CHUNK))
            rank += tl.sum((other[None, :] > packed[:, None]).to(tl.int32), axis=1)
    else:
        packed = tl.sort(packed, 0, descending=True)
        rank = tail
    column = (4294967295 - (packed & 4294967295)).to(tl.int32)
    valid = tail < want
    picked = tl.load(cand_row + column, mask=valid, other=-1).to(tl.int64)
    tl.store(out_row + rank, picked, mask=valid)
    tl.store(out_row + tail, tl.full([BLOCK_K], -1, tl.int64), mask=(tail >= want) & (tail < k))


@triton.jit
def _v3_select_kernel(
    scores_ptr, cand_ptr, out_ptr, scratch_ptr, num_cand, k,
    stride_st, stride_ct, stride_ot,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr,
    RANK_SORT: tl.constexpr, RANK_CHUNK: tl.constexpr,
):  # fmt: skip
    """One program per row: the k-th largest key by radix select, the winners (above it, then
    ties at it in column order, found with one prefix sum) packed as ``key << 32 | ~column``
    into a per-row scratch, then ordered there (a sort, or ranks by counting)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * stride_st + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    threshold = 4294967295  # nothing valid: nothing wins
    if want > 0:
        threshold = _v3_kth_largest_key(key, num_valid, want, BLOCK_C, DIGIT)
    win = key > threshold
    tied = (key == threshold) & (key > 0)
    slots = tl.cumsum(win.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)  # both counts at once
    num_above = tl.sum(win.to(tl.int32), axis=0)
    slot = tl.where(win, (slots & 65535) - 1, num_above + (slots >> 16) - 1)
    keep = win | (tied & (slot < want))
    packed = ((key ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32) + (
        4294967295 - offs.to(tl.int64))  # fmt: skip
    scratch = scratch_ptr + row * BLOCK_K
    tl.store(scratch + slot, packed, mask=keep)
    tail = tl.arange(0, BLOCK_K)
    tl.store(scratch + tail, tl.full([BLOCK_K], -9223372036854775808, tl.int64), mask=tail >= want)
    tl.debug_barrier()
    _v3_rank_and_store(scratch, cand_ptr + row * stride_ct, out_ptr + row * stride_ot, want, k,
                    BLOCK_K, RANK_CHUNK, RANK_SORT)  # fmt: skip


def _v3(scores, cand):
    out = torch.empty(ROWS, TOPK, dtype=torch.int64, device="cuda")
    scratch = torch.empty(ROWS, TOPK, dtype=torch.int64, device="cuda")

    def fn():
        _v3_select_kernel[(ROWS,)](
            scores, cand, out, scratch, WIDTH, TOPK, scores.stride(0), cand.stride(0),
            out.stride(0), BLOCK_C=WIDTH, BLOCK_K=TOPK, DIGIT=5, RANK_SORT=False,
            RANK_CHUNK=32, num_warps=16,
        )  # fmt: skip
        return out

    return fn


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
        us = time_cuda(fn, iters=100) * 1e3
    except Exception as e:  # a variant that does not compile is reported, not fatal
        print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        rows.append({"variant": name, "us": float("nan"), "check": "failed"})
        return
    print(f"{name}: {us:.1f} us {ok}", flush=True)
    rows.append({"variant": name, "us": us, "check": ok})


def _warm_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so that its clocks leave the idle state."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scores, cand = _inputs()
    ref = kernels.OPS["select_topk"].reference(scores, cand, TOPK)
    normal = torch.randn(ROWS, WIDTH, device="cuda")
    ref_normal = kernels.OPS["select_topk"].reference(normal, cand, TOPK)
    _warm_up()
    rows: list[dict] = []
    select = backend.ops["select_topk"]
    _time("v5 default", lambda: select(scores, cand, TOPK), rows, ref)
    _time("v3 (first call's best)", _v3(scores, cand), rows, ref)
    _time("torch.topk", lambda: scores.topk(TOPK, dim=-1), rows)
    for kw in ({"cap": 16384}, {"cap": 1024}, {"cap": 4096}, {"digit": 6}, {"digit": 4},
               {"cap": 16384, "digit": 6}):  # fmt: skip
        name = "v5 " + " ".join(f"{k}={v}" for k, v in kw.items())
        _time(name, lambda kw=kw: select(scores, cand, TOPK, **kw), rows, ref)
    _time("v5 default, randn scores", lambda: select(normal, cand, TOPK), rows, ref_normal)
    _time("v5 default again", lambda: select(scores, cand, TOPK), rows, ref)
    print_table(rows, ["variant", "us", "check"])
    write_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
