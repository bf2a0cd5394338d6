"""Top-k selection over indexer scores and V4.1's candidate-block pre-filter, in Triton.

Selection (``select_topk``): the radix-select kernel of :mod:`.indexer_select` (one program
per row; the result equals a stable descending sort's first k). Rows wider than
``TOPK_MAX_CANDIDATES`` take two selections (each segment's k best, then the best of those)
while the segments' winners fit one row; beyond that, torch's stable sort. ``candidate_block_mask`` keeps the earlier
binary-search kernel (winners in column order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.indexer_select import _ordered_key, launch_select
from deepinfer.kernels_nvidia.registry import implements

TOPK_MAX_CANDIDATES = 16384  # widest row the register-resident top-k kernel takes
SORT_BLOCK_ELEMENTS = 1 << 27  # scores per sort of the wide-row path (~1.5 GiB of sort output)
# Radix digits of 4, 5 and 6 bits measured within noise of each other; 16 warps, since 8 and 32
# spill registers.
SELECT_DIGIT = 5  # radix digit bits per pass (histograms of 2**SELECT_DIGIT bins)
SELECT_CAP = 2048  # keys left sharing the prefix when the radix passes move to a compact copy
SELECT_WARPS = 16  # most warps per selection program (16,384-wide rows)


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


def _topk_torch(scores, seq_rows, q_seq, k):
    """Wide rows: a stable descending sort (ties by column, like the kernel), over blocks of
    rows of at most ``SORT_BLOCK_ELEMENTS`` scores (the sort's values and int64 indices would
    otherwise triple the scores' memory: 48 GiB for a 131,072-token prompt's 32,768 entries)."""
    rows = scores.shape[0]
    step = max(1, SORT_BLOCK_ELEMENTS // max(1, scores.shape[-1]))
    if scores.dim() == 2 and rows > step:
        return torch.cat(
            [_topk_rows(scores[i : i + step], seq_rows, q_seq[i : i + step], k)
             for i in range(0, rows, step)]
        )  # fmt: skip
    return _topk_rows(scores, seq_rows, q_seq, k)


def _topk_rows(scores, seq_rows, q_seq, k):
    width = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = order.values[..., :width], order.indices[..., :width]
    picked = seq_rows.long()[q_seq.long()[:, None], indices]
    picked = picked.masked_fill(~torch.isfinite(values), -1)
    if width < k:
        picked = torch.nn.functional.pad(picked, (0, k - width), value=-1)
    return picked


@implements("select_topk")
def select_topk(scores, seq_rows, q_seq, k, *, digit=None, cap=None, num_warps=None):
    """The Triton radix select of :mod:`.indexer_select` (winners ordered in the same kernel,
    which reads each row's candidate values from its sequence's list); rows wider than
    ``TOPK_MAX_CANDIDATES``: two selections (:func:`_select_wide`), or torch's stable sort
    when the segments' winners would not fit one row. The keywords override the launch
    (benchmark sweeps); none changes the result. ``+inf`` / NaN scores are not expected (the
    scores are finite or ``-inf``)."""
    if scores.dim() != 2 or seq_rows.dim() != 2 or seq_rows.shape[1] != scores.shape[1]:
        raise ValueError(f"scores/seq_rows: expected [T, C]/[B, C], got "
                         f"{tuple(scores.shape)}/{tuple(seq_rows.shape)}")  # fmt: skip
    if q_seq.shape != scores.shape[:1]:
        raise ValueError(
            f"q_seq: expected shape {tuple(scores.shape[:1])}, got {tuple(q_seq.shape)}"
        )
    rows, width = scores.shape
    if scores.dtype != torch.float32:
        return _topk_torch(scores, seq_rows, q_seq, k)
    if rows == 0 or k == 0:
        return torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if width == 0:  # nothing visible yet (a step before the first compressed entry): all holes
        return torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    launch = dict(digit=digit or SELECT_DIGIT, cap=cap or SELECT_CAP, num_warps=num_warps)
    if width > TOPK_MAX_CANDIDATES:
        segments = -(-width // TOPK_MAX_CANDIDATES)
        if k * segments > TOPK_MAX_CANDIDATES:
            return _topk_torch(scores, seq_rows, q_seq, k)
        step = max(1, SORT_BLOCK_ELEMENTS // width)  # rows per block: bounded padded copies
        return torch.cat(
            [_select_wide(scores[i : i + step], seq_rows, q_seq[i : i + step], k, launch)
             for i in range(0, rows, step)]
        )  # fmt: skip
    return _select(scores, seq_rows, q_seq, k, launch)


def _select(scores, seq_rows, q_seq, k, launch):
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    seq_rows = seq_rows if seq_rows.stride(1) == 1 else seq_rows.contiguous()
    block_c = triton.next_power_of_2(max(scores.shape[1], 16))
    warps = launch["num_warps"] or min(SELECT_WARPS, max(4, block_c // 1024))
    return launch_select(scores, seq_rows, q_seq.contiguous(), k, digit=launch["digit"],
                         cap=launch["cap"], num_warps=warps)  # fmt: skip


def _select_wide(scores, seq_rows, q_seq, k, launch):
    """Rows wider than the kernel takes, in two selections with the same result as one: each
    segment of ``TOPK_MAX_CANDIDATES`` columns gives its k best in stable descending order,
    then the k best of the segments' winners, laid side by side in segment order. Equal
    scores stay in column order at both stages, so ties still go to the lowest column."""
    rows, width = scores.shape
    seg = TOPK_MAX_CANDIDATES
    segments = -(-width // seg)
    device = scores.device
    padded = torch.nn.functional.pad(scores, (0, segments * seg - width), value=-float("inf"))
    local = torch.arange(seg, device=device)[None]  # one list: each segment's own columns
    first = _select(padded.view(rows * segments, seg), local,
                    torch.zeros(rows * segments, dtype=torch.long, device=device), k, launch)  # fmt: skip
    column = first + (torch.arange(rows * segments, device=device) % segments)[:, None] * seg
    column = torch.where(first < 0, -1, column).view(rows, segments * k)
    best = padded.view(rows, segments * seg).gather(1, column.clamp(min=0))
    best = best.masked_fill(column < 0, -float("inf"))
    own = torch.arange(rows, device=device)  # each row's winners' columns, its own list
    picked = _select(best, column, own, k, launch)  # columns of the row's k best
    values = seq_rows[q_seq.long()[:, None], picked.clamp(min=0)].long()
    return torch.where(picked < 0, -1, values)


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
        chosen = _topk_torch(blocks, ids[None], torch.zeros_like(ids[:1]).expand(rows), count)
    else:
        chosen = _winner_positions(blocks, count).long()
    keep = torch.zeros(rows, num_blocks + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, torch.where(chosen < 0, num_blocks, chosen), True)
    return keep[:, :num_blocks].repeat_interleave(block_size, dim=-1)[:, :width]
