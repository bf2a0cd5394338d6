"""Top-k selection over indexer scores and V4.1's candidate-block pre-filter, in Triton.

Selection (``select_topk``): one program per row holds the row's scores in registers and finds
the k-th largest by a radix select on the order-preserving integer image of the fp32 bits:
four 8-bit digit histograms (most significant first), each narrowing the prefix of the
threshold. The winners (above the threshold, then ties at it in column order) are packed as
``key << 32 | ~column`` into a per-row scratch, sorted there in registers (descending: score,
then lowest column first) and written as candidate values, ``-1`` padding. The result equals a
stable descending sort's first k. Rows wider than ``TOPK_MAX_CANDIDATES`` use torch's stable
sort. ``candidate_block_mask`` keeps the earlier binary-search kernel (winners in column order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements

TOPK_MAX_CANDIDATES = 16384  # widest row the register-resident top-k kernel takes
SELECT_DIGIT = 5  # radix digit bits per pass (histograms of 2**SELECT_DIGIT bins)
SELECT_RANK_SORT = False  # order the winners by counting ranks instead of a bitonic sort
SELECT_WARPS = 16  # most warps per selection program (16,384-wide rows)


@triton.jit
def _ordered_key(scores):
    """uint32 keys in the order of the fp32 ``scores``; 0 for ``-inf`` / NaN (never chosen)."""
    scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 ties with +0.0, as in torch.sort
    bits = scores.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = (signed ^ -2147483648).to(tl.uint32, bitcast=True)
    return tl.where(scores > float("-inf"), key, 0)


@triton.jit
def _topk_kernel(
    scores_ptr, out_ptr, num_cand, k, stride_st, stride_ot,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per row: binary search on the key bits for the k-th largest score, then a
    prefix sum writes the winners' column positions in column order (ties at the threshold:
    lowest columns first; ``-1`` pads)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * stride_st + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    lo = tl.full([], 0, tl.int64)  # invariant: count(key >= lo) >= want
    hi = tl.full([], 4294967295, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        count = tl.sum((key >= mid.to(tl.uint32)).to(tl.int32), axis=0)
        lo = tl.where(count >= want, mid, lo)
        hi = tl.where(count >= want, hi, mid - 1)
    threshold = lo.to(tl.uint32)
    above = key > threshold
    num_above = tl.sum(above.to(tl.int32), axis=0)
    slot = tl.cumsum(above.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_ot + slot, offs, mask=above)
    tied = (key == threshold) & (key > 0)  # the places left go to ties in position order
    slot = num_above + tl.cumsum(tied.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_ot + slot, offs, mask=tied & (slot < want))
    tail = tl.arange(0, BLOCK_K)
    pad = (tail >= want) & (tail < k)
    tl.store(out_ptr + row * stride_ot + tail, tl.full([BLOCK_K], -1, tl.int32), mask=pad)


@triton.jit
def _kth_largest_key(key, match_count, want, BLOCK_C: tl.constexpr, DIGIT: tl.constexpr):
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
def _rank_and_store(scratch, cand_row, out_row, want, k, BLOCK_K: tl.constexpr,
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
def _select_kernel(
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
        threshold = _kth_largest_key(key, num_valid, want, BLOCK_C, DIGIT)
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
    _rank_and_store(scratch, cand_ptr + row * stride_ct, out_ptr + row * stride_ot, want, k,
                    BLOCK_K, RANK_CHUNK, RANK_SORT)  # fmt: skip


def _winner_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int32 columns of each row's k best finite scores, in column order, ``-1``
    pads (scores ``[T, C]`` fp32 with unit column stride, ``C <= TOPK_MAX_CANDIDATES``)."""
    rows, width = scores.shape
    positions = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    block_c = triton.next_power_of_2(max(width, 16))
    _topk_kernel[(rows,)](
        scores, positions, width, k, scores.stride(0), positions.stride(0),
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(k),
        num_warps=min(16, max(4, block_c // 1024)),
    )  # fmt: skip
    return positions


def _topk_torch(scores, candidates, k):
    """Wide rows: a stable descending sort (ties by column, like the kernel)."""
    width = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = order.values[..., :width], order.indices[..., :width]
    picked = candidates.long().gather(-1, indices)
    picked = picked.masked_fill(~torch.isfinite(values), -1)
    if width < k:
        picked = torch.nn.functional.pad(picked, (0, k - width), value=-1)
    return picked


def select_launch(width: int) -> dict:
    """Launch shape of the selection kernel for rows ``width`` wide (benchmarks override)."""
    block_c = triton.next_power_of_2(max(width, 16))
    return {"digit": SELECT_DIGIT, "rank_sort": SELECT_RANK_SORT,
            "num_warps": min(SELECT_WARPS, max(4, block_c // 1024))}  # fmt: skip


@implements("select_topk")
def select_topk(scores, candidates, k, *, digit=None, rank_sort=None, num_warps=None):
    """Rows up to ``TOPK_MAX_CANDIDATES`` wide: the Triton radix select with the winners
    ordered in the same kernel; wider rows: torch's stable sort. The keywords override the
    launch (benchmark sweeps); none changes the result.
    ``+inf`` / NaN scores are not expected (the scores are finite or ``-inf``)."""
    if scores.shape != candidates.shape or scores.dim() != 2:
        raise ValueError(
            f"candidates: expected shape {tuple(scores.shape)}, got {tuple(candidates.shape)}"
        )
    rows, width = scores.shape
    if width > TOPK_MAX_CANDIDATES or scores.dtype != torch.float32:
        return _topk_torch(scores, candidates, k)
    if rows == 0 or k == 0:
        return torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if width == 0:  # nothing visible yet (a step before the first compressed entry): all holes
        return torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    candidates = candidates if candidates.stride(1) == 1 else candidates.contiguous()
    launch = select_launch(width)
    block_k = triton.next_power_of_2(k)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    scratch = torch.empty(rows, block_k, dtype=torch.int64, device=scores.device)
    rank_sort = launch["rank_sort"] if rank_sort is None else rank_sort
    _select_kernel[(rows,)](
        scores, candidates, out, scratch, width, k,
        scores.stride(0), candidates.stride(0), out.stride(0),
        BLOCK_C=triton.next_power_of_2(max(width, 16)), BLOCK_K=block_k,
        DIGIT=digit or launch["digit"], RANK_SORT=bool(rank_sort),
        RANK_CHUNK=min(block_k, 32), num_warps=num_warps or launch["num_warps"],
    )  # fmt: skip
    return out


@implements("candidate_block_mask")
def candidate_block_mask(scores, visible_count, topk_blocks, block_size):
    """Block maxima (torch), the newest visible block forced in, then the top-k kernel picks
    the blocks (ties: the earlier block); the mask is the chosen blocks' columns."""
    if scores.dim() != 2 or visible_count.shape != (scores.shape[0],):
        raise ValueError(f"scores/visible_count: expected [T, C]/[T], got "
                         f"{tuple(scores.shape)}/{tuple(visible_count.shape)}")  # fmt: skip
    rows, width = scores.shape
    if width == 0:
        return torch.zeros(rows, 0, dtype=torch.bool, device=scores.device)
    padded = torch.nn.functional.pad(scores.float(), (0, -width % block_size), value=-float("inf"))
    blocks = padded.unflatten(-1, (-1, block_size)).amax(-1)  # [T, nb]
    num_blocks = blocks.shape[-1]
    ids = torch.arange(num_blocks, device=scores.device)
    newest = (visible_count.long() - 1).div(block_size, rounding_mode="floor").unsqueeze(-1)
    blocks = blocks.masked_fill(ids == newest, float("inf")).contiguous()
    count = min(topk_blocks, num_blocks)
    if num_blocks > TOPK_MAX_CANDIDATES:
        chosen = _topk_torch(blocks, ids.expand(rows, -1), count)
    else:
        chosen = _winner_positions(blocks, count).long()
    keep = torch.zeros(rows, num_blocks + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, torch.where(chosen < 0, num_blocks, chosen), True)
    return keep[:, :num_blocks].repeat_interleave(block_size, dim=-1)[:, :width]
