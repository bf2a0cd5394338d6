"""The top-k selection kernel behind ``select_topk`` (one program per row, rows up to
16,384 wide), in Triton.

1. Keys: the fp32 scores mapped to uint32 in the same order (``-0.0`` as ``+0.0``; ``-inf``
   and NaN to 0, never chosen).
2. Threshold: the ``want``-th largest key (``want = min(k, finite scores)``) by a radix select,
   ``DIGIT`` bits per pass, most significant first. Each pass is one ``2**DIGIT``-bin histogram
   with no mask: keys outside the current prefix all land in bin 0 and their known number is
   taken back out. It stops once every key left in the chosen bin is needed. When at most
   ``CAP`` keys still share the prefix, they are compacted into a small per-row buffer and the
   remaining passes run over that buffer instead of the whole row.
3. Winners: every key above the threshold, then the lowest-column ties at it, packed as
   ``key << 32 | ~column`` (one descending sort then orders by score, lowest column first)
   into a per-row scratch of ``BLOCK_K`` slots.
4. Order: a bitonic sort of the scratch; the first ``want`` become candidate values (read from
   the row's sequence's list), ``-1`` pads to ``k``.

Compaction slots (steps 2 and 3) come without a full-width prefix sum (Triton lowers a
16,384-long ``cumsum`` to a chain of shuffles per register, about 12 us here): the row is
re-read as ``[R, NT]`` tiles where each tile column is a run of ``R`` consecutive columns, each
run's mask becomes one 32-bit word, and a rank is a popcount plus a prefix sum over the ``NT``
runs. No atomics: the result is deterministic, depends on the row alone (batch invariant) and
equals the first k of a stable descending sort. (Slots from ``tl.atomic_add`` were tried: ptxas
aggregates them per warp but waits for each returned slot before the next, up to 32 round
trips per warp, so they were dropped unmeasured.)
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
    or at most ``stop_count`` keys match. Returns the updated state and ``low``: the matching
    keys agree on bits ``low..31`` (``low == 32``: no pass ran)."""
    NB: tl.constexpr = 1 << DIGIT
    bins = tl.arange(0, NB)
    found = (match_count == rest).to(tl.int32)
    low = tl.full([], 32, tl.int32)
    while (shift >= 0) & (found == 0) & (match_count > stop_count):
        low = shift
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
    return match, match_count, rest, shift, found, low


@triton.jit
def _popcount(x):
    """Set bits of each uint32 (SWAR; the interpreter has no ``popc``)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _row_keys(scores_row, num_cand, R: tl.constexpr, NT: tl.constexpr):
    """The row's keys as ``[R, NT]``, element ``(r, t)`` = column ``t * R + r`` (so each of the
    ``NT`` runs of ``R`` columns is one column of the tile), and those column numbers."""
    cols = tl.arange(0, NT)[None, :] * R + tl.arange(0, R)[:, None]
    scores = tl.load(scores_row + cols, mask=cols < num_cand, other=-float("inf"))
    return _ordered_key(scores), cols


@triton.jit
def _column_ranks(first, second, R: tl.constexpr):
    """For two disjoint ``[R, NT]`` masks laid out as in :func:`_row_keys`: each element's rank
    among its mask's set elements in column order, and each mask's count. One bit mask per run
    of ``R`` columns, popcounts, and one prefix sum over the ``NT`` runs; no full-width scan."""
    bit = tl.full([R, 1], 1, tl.uint32) << tl.arange(0, R)[:, None].to(tl.uint32)
    bits_a = tl.sum(tl.where(first, bit, 0), axis=0)  # [NT]: distinct bits, so sum == or
    bits_b = tl.sum(tl.where(second, bit, 0), axis=0)
    counts = _popcount(bits_a) + (_popcount(bits_b) << 16)  # both <= 16384: no carry
    before = tl.cumsum(counts, axis=0) - counts
    lower = bit - 1
    rank_a = (before & 65535)[None, :] + _popcount(bits_a[None, :] & lower)
    rank_b = (before >> 16)[None, :] + _popcount(bits_b[None, :] & lower)
    total = tl.sum(counts, axis=0)
    return rank_a.to(tl.int32), rank_b.to(tl.int32), (total & 65535).to(tl.int32)


@triton.jit
def _threshold(key, num_valid, want, scores_row, num_cand, work,
               BLOCK_C: tl.constexpr, DIGIT: tl.constexpr, CAP: tl.constexpr,
               R: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """The ``want``-th largest key (``UINT32_MAX`` when ``want == 0``); ``work`` is the row's
    int32 compaction buffer of ``CAP`` slots."""
    shift = tl.full([], 32 - DIGIT, tl.int32)
    match = key > 0
    if CAP < BLOCK_C:
        match, count, rest, shift, found, low = _radix_narrow(
            key, match, num_valid, want, shift, CAP, BLOCK_C, DIGIT
        )
        if (found == 0) & (shift >= 0):  # <= CAP keys left: finish over a compact copy
            fixed = ((tl.full([], UINT32_MAX, tl.int64) << low) & UINT32_MAX).to(tl.uint32)
            prefix = tl.max(tl.where(match, key, 0), axis=0) & fixed
            key2, _ = _row_keys(scores_row, num_cand, R, NT)
            in_prefix = (key2 > 0) & ((key2 & fixed) == prefix)
            slot, _, _ = _column_ranks(in_prefix, key2 < 0, R)
            tl.store(work + slot, key2.to(tl.int32, bitcast=True), mask=in_prefix)
            tl.debug_barrier()
            lane = tl.arange(0, CAP)
            small = tl.load(work + lane, mask=lane < count, other=0)
            small = small.to(tl.uint32, bitcast=True)
            small_match, _, _, _, _, _ = _radix_narrow(
                small, small > 0, count, rest, shift, 0, CAP, DIGIT
            )
            threshold = tl.min(tl.where(small_match, small, UINT32_MAX), axis=0)
        else:
            threshold = tl.min(tl.where(match, key, UINT32_MAX), axis=0)
    else:
        match, _, _, _, _, _ = _radix_narrow(key, match, num_valid, want, shift, 0, BLOCK_C, DIGIT)
        threshold = tl.min(tl.where(match, key, UINT32_MAX), axis=0)
    return threshold


@triton.jit
def _gather_winners(threshold, want, scores_row, num_cand, scratch, BLOCK_K: tl.constexpr,
                    R: tl.constexpr, NT: tl.constexpr):  # fmt: skip
    """Fill ``scratch[:BLOCK_K]`` with the packed winners (every key above the threshold, then
    the lowest-column ties at it) and ``INT64_MIN`` after them."""
    key, cols = _row_keys(scores_row, num_cand, R, NT)
    win = key > threshold  # no valid key reaches UINT32_MAX (the threshold when want == 0)
    tied = (key == threshold) & (key > 0)
    rank_win, rank_tied, num_above = _column_ranks(win, tied, R)
    slot = tl.where(win, rank_win, num_above + rank_tied)
    packed = ((key ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32) + (
        cols.to(tl.int64) ^ UINT32_MAX)  # fmt: skip
    tl.store(scratch + slot, packed, mask=win | (tied & (slot < want)))
    tail = tl.arange(0, BLOCK_K)
    tl.store(scratch + tail, tl.full([BLOCK_K], INT64_MIN, tl.int64), mask=tail >= want)


@triton.jit
def _select_kernel(
    scores_ptr, rows_ptr, seq_ptr, out_ptr, scratch_ptr, work_ptr, num_cand, k,
    stride_st, stride_rs, stride_ot,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DIGIT: tl.constexpr, CAP: tl.constexpr,
    R: tl.constexpr,
):  # fmt: skip
    """One program per row (see the module docstring)."""
    NT: tl.constexpr = BLOCK_C // R
    row = tl.program_id(0).to(tl.int64)
    scores_row = scores_ptr + row * stride_st
    offs = tl.arange(0, BLOCK_C)
    key = _ordered_key(tl.load(scores_row + offs, mask=offs < num_cand, other=-float("inf")))
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    threshold = _threshold(key, num_valid, want, scores_row, num_cand, work_ptr + row * CAP,
                           BLOCK_C, DIGIT, CAP, R, NT)  # fmt: skip
    scratch = scratch_ptr + row * BLOCK_K
    _gather_winners(threshold, want, scores_row, num_cand, scratch, BLOCK_K, R, NT)
    tl.debug_barrier()
    tail = tl.arange(0, BLOCK_K)
    packed = tl.sort(tl.load(scratch + tail), 0, descending=True)
    column = ((packed & UINT32_MAX) ^ UINT32_MAX).to(tl.int32)  # undo ~column
    valid = tail < want
    cand_row = rows_ptr + tl.load(seq_ptr + row).to(tl.int64) * stride_rs
    picked = tl.load(cand_row + column, mask=valid, other=-1).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + tail, tl.where(valid, picked, -1), mask=tail < k)


def launch_select(scores, seq_rows, q_seq, k, *, digit, cap, num_warps):
    """``[T, k]`` int64 candidates ``seq_rows[q_seq[t], c]`` of each row's k best finite
    scores (``scores`` ``[T, C]`` fp32 and ``seq_rows`` ``[B, C]`` with unit column stride,
    ``q_seq`` ``[T]`` contiguous, ``1 <= C <= 16384``, ``k >= 1``). ``cap >= C`` turns the
    compaction off."""
    rows, width = scores.shape
    block_c = triton.next_power_of_2(max(width, 16))
    if block_c > 16384:
        raise ValueError(f"scores: at most 16384 columns, got {width}")
    block_k = triton.next_power_of_2(k)
    cap = min(triton.next_power_of_2(cap), block_c)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    scratch = torch.empty(rows, block_k, dtype=torch.int64, device=scores.device)
    work = torch.empty(rows, cap, dtype=torch.int32, device=scores.device)
    _select_kernel[(rows,)](
        scores, seq_rows, q_seq, out, scratch, work, width, k,
        scores.stride(0), seq_rows.stride(0), out.stride(0),
        BLOCK_C=block_c, BLOCK_K=block_k, DIGIT=digit, CAP=cap,
        R=max(1, block_c // 512), num_warps=num_warps,
    )  # fmt: skip
    return out
