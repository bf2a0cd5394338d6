"""The top-k selection kernel behind ``select_topk`` (one program per row, rows up to
16,384 wide), in Triton.

1. Keys: the fp32 scores mapped to uint32 in the same order (``-0.0`` as ``+0.0``; ``-inf``
   and NaN to 0, never chosen).
2. Threshold: the ``want``-th largest key (``want = min(k, finite scores)``) by a radix select,
   ``DIGIT`` bits per pass, most significant first. Each pass is one ``2**DIGIT``-bin histogram
   with no mask: keys outside the current prefix all land in bin 0 and their known number is
   taken back out. It stops once every key left in the chosen bin is needed. When at most
   ``CAP`` keys still share the prefix, they are compacted into a small per-row buffer
   (slots from an atomic counter: the order there does not matter) and the remaining passes
   run over that buffer instead of the whole row.
3. Winners: every key >= the threshold, packed as ``key << 32 | ~column`` (so one descending
   sort orders by score, then lowest column first), gathered into a per-row scratch of
   ``BLOCK_K`` slots through an atomic counter; only when ties at the threshold overflow the
   scratch does a prefix sum pick the lowest-column ties in order.
4. Order: a bitonic sort of the scratch; the first ``want`` become candidate values, ``-1``
   pads to ``k``.

A row's result depends on its own scores only (batch invariant) and equals the first k of a
stable descending sort. H200, 64 rows x 16,384 real indexer scores, k = 512: see
``benchmarks/kernels/bench_indexer.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

UINT32_MAX = tl.constexpr(4294967295)
INT64_MIN = tl.constexpr(-9223372036854775808)


@triton.jit
def _ordered_key(scores):
    """uint32 keys in the order of the fp32 ``scores``; 0 for ``-inf`` / NaN (never chosen)."""
    scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 ties with +0.0, as in torch.sort
    bits = scores.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = (signed ^ -2147483648).to(tl.uint32, bitcast=True)
    return tl.where(scores > float("-inf"), key, 0)


@triton.jit
def _radix_narrow(key, match, match_count, rest, shift, stop_count,
                  BLOCK: tl.constexpr, DIGIT: tl.constexpr):  # fmt: skip
    """Radix passes over ``key[BLOCK]`` narrowing ``match`` (the ``match_count`` keys sharing
    the prefix fixed so far, among which the ``rest``-th largest is sought) from bit ``shift``
    down, until every matching key is needed (``found``), all bits are fixed (``shift < 0``)
    or at most ``stop_count`` keys match. Returns the updated state."""
    NB: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NB)
    found = (match_count == rest).to(tl.int32)
    while (shift >= 0) & (found == 0) & (match_count > stop_count):
        digit = ((key >> shift.to(tl.uint32)) & (NB - 1)).to(tl.int32)
        hist = tl.histogram(tl.where(match, digit, 0), NB)
        hist -= tl.where(bins == 0, BLOCK - match_count, 0)  # the non-matching keys
        at_or_above = match_count - tl.cumsum(hist, axis=0) + hist  # count(digit >= b)
        chosen = tl.sum((at_or_above >= rest).to(tl.int32), axis=0) - 1
        picked = tl.sum(tl.where(bins == chosen, hist + (at_or_above << 16), 0), axis=0)
        in_bin = picked & 65535
        rest -= (picked >> 16) - in_bin  # the keys in higher bins are all winners
        match = match & (digit == chosen)
        match_count = in_bin
        found = (in_bin == rest).to(tl.int32)  # every key left with this prefix is a winner
        shift = tl.where(shift == 0, -1, tl.maximum(shift - DIGIT, 0))
    return match, match_count, rest, shift, found


@triton.jit
def _threshold(key, num_valid, want, work, BLOCK_C: tl.constexpr, DIGIT: tl.constexpr,
               CAP: tl.constexpr):  # fmt: skip
    """The ``want``-th largest key (``UINT32_MAX`` when ``want == 0``). ``work`` points at the
    row's int32 work area: ``[0]`` a zeroed counter, ``[2:2 + CAP]`` the compaction buffer."""
    shift = tl.full([], 32 - DIGIT, tl.int32)
    match = key > 0
    if CAP < BLOCK_C:
        match, count, rest, shift, found = _radix_narrow(
            key, match, num_valid, want, shift, CAP, BLOCK_C, DIGIT
        )
        if (found == 0) & (shift >= 0):  # <= CAP keys left: finish over a compact copy
            slot = tl.atomic_add(work + tl.zeros_like(key).to(tl.int32), 1, mask=match,
                                 sem="relaxed")  # fmt: skip
            tl.store(work + 2 + slot, key.to(tl.int32, bitcast=True), mask=match)
            tl.debug_barrier()
            lane = tl.arange(0, CAP)
            small = tl.load(work + 2 + lane, mask=lane < count, other=0)
            small = small.to(tl.uint32, bitcast=True)
            small_match, _, _, _, _ = _radix_narrow(
                small, small > 0, count, rest, shift, 0, CAP, DIGIT
            )
            threshold = tl.min(tl.where(small_match, small, UINT32_MAX), axis=0)
        else:
            threshold = tl.min(tl.where(match, key, UINT32_MAX), axis=0)
    else:
        match, _, _, _, _ = _radix_narrow(key, match, num_valid, want, shift, 0, BLOCK_C, DIGIT)
        threshold = tl.min(tl.where(match, key, UINT32_MAX), axis=0)
    return threshold


@triton.jit
def _gather_winners(key, offs, threshold, want, scratch, work, BLOCK_K: tl.constexpr,
                    ATOMIC: tl.constexpr):  # fmt: skip
    """Fill ``scratch[:BLOCK_K]`` with the packed winners, then ``INT64_MIN``; the first
    ``want`` of its descending order are the answer. ``work[1]`` is a zeroed counter."""
    valid = key > 0  # and no valid key reaches UINT32_MAX (the threshold when want == 0)
    at_least = valid & (key >= threshold)
    packed = ((key ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32) + (
        offs.to(tl.int64) ^ UINT32_MAX)  # fmt: skip
    count = tl.sum(at_least.to(tl.int32), axis=0)
    tail = tl.arange(0, BLOCK_K)
    fits = count <= BLOCK_K
    if not ATOMIC:
        fits = count < 0  # never: always the prefix sum
    if fits:  # all of them fit (the usual case): any slot order will do
        slot = tl.atomic_add(work + 1 + tl.zeros_like(offs), 1, mask=at_least, sem="relaxed")
        tl.store(scratch + slot, packed, mask=at_least)
        tl.store(scratch + tail, tl.full([BLOCK_K], INT64_MIN, tl.int64), mask=tail >= count)
    else:  # many ties at the threshold: the lowest columns among them, by a prefix sum
        win = valid & (key > threshold)
        tied = valid & (key == threshold)
        slots = tl.cumsum(win.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
        num_above = tl.sum(win.to(tl.int32), axis=0)
        slot = tl.where(win, (slots & 65535) - 1, num_above + (slots >> 16) - 1)
        tl.store(scratch + slot, packed, mask=win | (tied & (slot < want)))
        tl.store(scratch + tail, tl.full([BLOCK_K], INT64_MIN, tl.int64), mask=tail >= want)


@triton.jit
def _select_kernel(
    scores_ptr, cand_ptr, out_ptr, scratch_ptr, work_ptr, num_cand, k,
    stride_st, stride_ct, stride_ot,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr, CAP: tl.constexpr,
    ATOMIC: tl.constexpr,
):  # fmt: skip
    """One program per row (see the module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    work = work_ptr + row * (CAP + 2)
    tl.store(work + tl.arange(0, 2), tl.zeros([2], tl.int32))  # the two atomic counters
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * stride_st + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    tl.debug_barrier()  # the zeroed counters before any atomic
    threshold = _threshold(key, num_valid, want, work, BLOCK_C, DIGIT, CAP)
    scratch = scratch_ptr + row * BLOCK_K
    _gather_winners(key, offs, threshold, want, scratch, work, BLOCK_K, ATOMIC)
    tl.debug_barrier()
    tail = tl.arange(0, BLOCK_K)
    packed = tl.sort(tl.load(scratch + tail), 0, descending=True)
    column = ((packed & UINT32_MAX) ^ UINT32_MAX).to(tl.int32)  # undo ~column
    valid = tail < want
    picked = tl.load(cand_ptr + row * stride_ct + column, mask=valid, other=-1).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + tail, tl.where(valid, picked, -1), mask=tail < k)


def launch_select(scores, candidates, k, *, digit, cap, num_warps, atomic=True):
    """``[T, k]`` int64 candidates of each row's k best finite scores (``scores`` ``[T, C]``
    fp32 and ``candidates`` ``[T, C]`` with unit column stride, ``1 <= C``, ``k >= 1``).
    ``atomic=False`` uses no atomic counter: no compaction, winners always by prefix sum."""
    rows, width = scores.shape
    block_c = triton.next_power_of_2(max(width, 16))
    block_k = triton.next_power_of_2(k)
    cap = min(triton.next_power_of_2(cap), block_c) if atomic else block_c
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    scratch = torch.empty(rows, block_k, dtype=torch.int64, device=scores.device)
    work = torch.empty(rows, cap + 2, dtype=torch.int32, device=scores.device)
    _select_kernel[(rows,)](
        scores, candidates, out, scratch, work, width, k,
        scores.stride(0), candidates.stride(0), out.stride(0),
        BLOCK_C=block_c, BLOCK_K=block_k, DIGIT=digit, CAP=cap, ATOMIC=atomic,
        num_warps=num_warps,
    )  # fmt: skip
    return out
