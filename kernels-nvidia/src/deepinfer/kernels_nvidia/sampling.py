"""Sampling kernels in Triton: grammar-mask apply, top-k/top-p/min-p cutoff, seeded Gumbel draw.

* ``apply_token_bitmask``: one program per (row, block of tokens); reads each logit once.
* ``top_k_top_p_min_p_cutoff``: one program per row, no sort. Every filter keeps the values at
  or above a threshold, so each threshold is found by a 16-ary search over the order-preserving
  integer encoding of float32, snapping the bracket to row values after each pass (so it stops
  when one distinct value is left; 8 passes at most): top-k searches for the smallest
  ``x`` with ``count(s > x) < k``, top-p for the smallest ``x`` with
  ``mass(s > x, s >= t_k) < top_p * Z_k``; min-p is one pass. The top-k search starts at the
  k-th largest block maximum, the top-p search at ``m + log((1 - p) Z_k / 4V)``. The answer is the smallest kept
  value, as in the reference; ties at the cut are kept.
* ``gumbel_sample``: the row is split into chunks; each program computes the counter-hash
  Gumbel noise of its tokens in registers and reduces ``argmax(s + g)`` (lowest index on ties),
  and a tiny torch step picks the best chunk (first on ties). No ``[B, V]`` noise is stored.
All reductions run within a row in an order fixed by the vocabulary size: batch invariant.
FMA contraction is off (``enable_fp_fusion=False``) so ``logits * (1 / T)`` and ``s + g`` round
exactly like the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.counter_hash import row_keys
from deepinfer.kernels_nvidia.registry import implements

_NUM_PIVOTS = 16


@triton.jit
def _bitmask_kernel(
    logits_ptr, bitmask_ptr, out_ptr, vocab, stride_l, stride_b, stride_o, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=0.0)
    words = tl.load(bitmask_ptr + row * stride_b + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    y = tl.where(allowed, x, float("-inf")).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=inside)


@implements("apply_token_bitmask")
def apply_token_bitmask(logits, bitmask, *, out=None):
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask: expected int32 [{rows}, >= {(vocab + 31) // 32}], got "
            f"{bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if logits.stride(-1) != 1:
        raise ValueError("logits: expected unit column stride")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    if out is None:
        out = torch.empty_like(logits)
    block = 1024
    grid = (rows, triton.cdiv(vocab, block))
    _bitmask_kernel[grid](
        logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), out.stride(0),
        BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _float_to_key(s):
    """Order-preserving int64 key of float32 values."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _key_to_float(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _stats_above(row_ptr, vocab, inv_t, m, t_k, pivots, IS_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Per pivot: the count (or top-k-restricted mass ``exp(s - m)``) of values strictly above
    it, the smallest value above it and the largest value at or below it."""
    acc = tl.zeros(pivots.shape, dtype=tl.float32)
    next_above = tl.full(pivots.shape, float("inf"), tl.float32)
    last_below = tl.full(pivots.shape, float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        if IS_MASS:
            w = tl.where(s >= t_k, tl.exp(s - m), 0.0)
        else:
            w = tl.full([BLOCK], 1.0, tl.float32)
        above = s[:, None] > pivots[None, :]
        acc += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
        s2 = s[:, None] + tl.zeros_like(pivots)[None, :]
        next_above = tl.minimum(next_above, tl.min(tl.where(above, s2, float("inf")), axis=0))
        last_below = tl.maximum(last_below, tl.max(tl.where(above, float("-inf"), s2), axis=0))
    return acc, next_above, last_below


@triton.jit
def _search(row_ptr, vocab, inv_t, m, t_k, target, lo, hi,
            IS_MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):  # fmt: skip
    """Smallest key in [lo, hi] whose stat is < target. The stat is non-increasing in the key,
    true at ``hi`` and changes only at row values, so the answer is ``lo`` or a row value: each
    pass evaluates NP pivots and snaps the bracket to the row values around the first true
    one, so it ends as soon as the bracket holds one distinct value (at most 8 passes)."""
    j = tl.arange(0, NP).to(tl.int64)
    while lo < hi:
        pivot_keys = lo + ((hi - lo) * j) // NP
        stats, next_above, last_below = _stats_above(
            row_ptr, vocab, inv_t, m, t_k, _key_to_float(pivot_keys), IS_MASS, BLOCK
        )
        first = tl.min(tl.where(stats < target, j, NP))
        if first == 0:
            hi = lo
        else:
            lo = _float_to_key(tl.max(tl.where(j == first - 1, next_above, float("-inf"))))
            if first < NP:
                hi = _float_to_key(tl.max(tl.where(j == first, last_below, float("-inf"))))
    return _key_to_float(lo)


@triton.jit
def _row_pass(row_ptr, vocab, inv_t, m, threshold, min_p, BLOCK: tl.constexpr):
    """Running max of s; smallest s >= threshold; count below threshold; smallest s whose
    ``exp(s - m) >= min_p``; sum of exp(s - m) over s >= threshold."""
    big = float("inf")
    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    min_kept = tl.full([BLOCK], big, tl.float32)
    min_p_kept = tl.full([BLOCK], big, tl.float32)
    below = tl.zeros([BLOCK], tl.float32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        row_max = tl.maximum(row_max, s)
        kept = s >= threshold
        min_kept = tl.minimum(min_kept, tl.where(kept & inside, s, big))
        below += tl.where(kept | ~inside, 0.0, 1.0)
        e = tl.exp(s - m)
        min_p_kept = tl.minimum(min_p_kept, tl.where((e >= min_p) & inside, s, big))
        mass += tl.where(kept & inside, e, 0.0)
    return tl.max(row_max), tl.min(min_kept), tl.sum(below), tl.min(min_p_kept), tl.sum(mass)


@triton.jit
def _max_pass(row_ptr, vocab, inv_t, k, BLOCK: tl.constexpr, NB: tl.constexpr):
    """The row max, and a lower bound on the k-th largest value: the k-th largest of the
    per-block maxima (k blocks hold a value at least that large); -inf when k > NB."""
    ids = tl.arange(0, NB)
    maxima = tl.full([NB], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        maxima = tl.where(ids == start // BLOCK, tl.max(s), maxima)
    ordered = tl.sort(maxima, descending=True)
    bound = tl.max(tl.where(ids.to(tl.int64) == k - 1, ordered, float("-inf")))
    return tl.max(maxima), bound


@triton.jit
def _cutoff_kernel(
    logits_ptr, stride, inv_t_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, vocab,
    BLOCK: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + row)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    neg_inf = tl.full([], float("-inf"), tl.float32)
    m, k_bound = _max_pass(row_ptr, vocab, inv_t, k, BLOCK, NB)
    hi = _float_to_key(m)
    t_k = neg_inf
    if (k > 0) & (k < vocab):
        t_k = _search(row_ptr, vocab, inv_t, m, neg_inf, k.to(tl.float32), _float_to_key(k_bound),
                      hi, False, BLOCK, NP)  # fmt: skip
    _, _, _, t_min_p, z_k = _row_pass(row_ptr, vocab, inv_t, m, t_k, min_p, BLOCK)
    if min_p <= 0.0:
        t_min_p = neg_inf
    t_p = neg_inf
    if p < 1.0:
        # Values with exp(s - m) < tau = (1 - p) Z_k / (4 V) hold less than (1 - p) Z_k / 4 in
        # total, so the mass above each exceeds p Z_k: the top-p cut is at least m + log(tau).
        p_bound = m + tl.log((1.0 - p) * z_k / (4.0 * vocab))
        lo_p = tl.maximum(_float_to_key(t_k), _float_to_key(p_bound))
        t_p = _search(row_ptr, vocab, inv_t, m, t_k, p * z_k, lo_p, hi,
                      True, BLOCK, NP)  # fmt: skip
    cut = tl.maximum(tl.maximum(t_k, t_p), t_min_p)
    _, smallest_kept, num_below, _, _ = _row_pass(row_ptr, vocab, inv_t, m, cut, 2.0, BLOCK)
    tl.store(out_ptr + row, tl.where(num_below == 0, neg_inf, smallest_kept))


def _row_floats(t: torch.Tensor, rows: int, name: str, device) -> torch.Tensor:
    if t.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.float32).contiguous()


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with unit column stride, got {logits.shape}")


@implements("top_k_top_p_min_p_cutoff")
def top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p):
    _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    inv_t = 1.0 / _row_floats(temperature, rows, "temperature", device)
    if top_k.shape != (rows,):
        raise ValueError(f"top_k: expected shape ({rows},), got {tuple(top_k.shape)}")
    top_k = top_k.to(device=device, dtype=torch.int32).contiguous()
    top_p = _row_floats(top_p, rows, "top_p", device)
    min_p = _row_floats(min_p, rows, "min_p", device)
    out = torch.empty(rows, dtype=torch.float32, device=device)
    # at least ~8 blocks per row so the block maxima bound top-k usefully at small vocabularies
    block = min(1024, max(64, triton.next_power_of_2(triton.cdiv(vocab, 8))))
    num_blocks = triton.next_power_of_2(triton.cdiv(vocab, block))
    _cutoff_kernel[(rows,)](
        logits, logits.stride(0), inv_t, top_k, top_p, min_p, out, vocab,
        BLOCK=block, NP=_NUM_PIVOTS, NB=num_blocks, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _gumbel_kernel(
    logits_ptr, stride, inv_t_ptr, cutoff_ptr, keys_ptr, best_ptr, best_idx_ptr, vocab,
    num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + row)
    cutoff = tl.load(cutoff_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = (chunk * CHUNK).to(tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        z = key + (cols.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = s + (-tl.log(-tl.log(u)))
        score = tl.where((s >= cutoff) & (s > float("-inf")) & inside, score, float("-inf"))
        block_best = tl.max(score)
        block_idx = tl.min(tl.where(score == block_best, cols, 2147483647))
        if block_best > best:
            best = block_best
            best_idx = block_idx
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


@implements("gumbel_sample")
def gumbel_sample(logits, temperature, cutoff, seeds, positions, stream):
    _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    inv_t = 1.0 / _row_floats(temperature, rows, "temperature", device)
    cutoff = _row_floats(cutoff, rows, "cutoff", device)
    keys = row_keys(seeds.to(device), positions.to(device), stream).contiguous()
    block = min(1024, triton.next_power_of_2(vocab))
    chunk = max(block, min(8192, triton.next_power_of_2(triton.cdiv(vocab, 16))))
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    _gumbel_kernel[(rows, num_chunks)](
        logits, logits.stride(0), inv_t, cutoff, keys, best, best_idx, vocab, num_chunks,
        CHUNK=chunk, BLOCK=block, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    winner = torch.argmax(best, dim=1, keepdim=True)  # first chunk on ties: lowest index
    return best_idx.gather(1, winner).squeeze(1).to(torch.int64)
