"""The top-k / top-p / min-p cutoff in Triton, spread over the whole GPU.

Every filter keeps the values at or above a threshold, so the answer is one value per row. The
row is cut into chunks (grid ``(rows, chunks)``; the chunk size is a function of the vocabulary
only; the extremes and histogram programs load their whole chunk at once and reduce once, so
all their loads are in flight together) and three or four launches find it:

1. ``_extremes_kernel``: per chunk, the max and min of ``s = logits * (1 / T)``.
2. ``_histogram_kernel``: per row, a histogram of the gap ``m - s`` to the row max ``m`` in
   bins of ~19% width (4 per octave; integer atomics, so order independent); for rows that need
   them, the exact int64 mass ``Z = sum trunc(exp(s - m) 2**40)`` and the min-p threshold.
3. ``_gather_kernel``: the candidates are the values in the first bins: with top-k, the fewest
   bins holding k values; with top-p alone, as many as fit ``cap``, the first ``sort_cap`` of
   them in a first tier. Each chunk appends its candidates to the row's buffer (per tier), in
   blocks of 1,024; a chunk whose max is past the last candidate bin loads nothing.
4. ``_finish_kernel`` (one program per row; or, with ``fused_finish``, the last chunk program
   of the row to finish its gather): ``sampling_cutoff_search.finish_row`` reads the exact cut
   off the candidates (sorted, or searched), or searches the row when they cannot hold it.

Masses are exact integer sums, so the result never depends on the summation order, the batch or
the device: it is bit-identical to the reference twin. The candidates' append order varies run
to run; the finishing step does not depend on it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements
from deepinfer.kernels_nvidia.sampling_cutoff_search import exp_nonpositive, finish_row, fixed_mass

NUM_BINS = 64  # bin 0: gap < 1/16; then 4 bins per octave up to ~4000 nats; the last: the rest
DEFAULT_CAP = 8192  # candidates per row; more: the row is searched
# these defaults (sort cap 256, at most 16 chunks) beat (1024, 32) in the H200 sweep; at
# V = 129,280 both chunkings give 32 chunks of 4,096 (the chunk is capped at 4,096)
DEFAULT_SORT_CAP = 256  # candidates sorted in registers instead of searched
_CAND_BLOCK = 256
_GATHER_BLOCK = 1024
_MAX_CHUNKS = 16


@triton.jit
def _gap_bin(s, m, NB: tl.constexpr):
    """Histogram bin of ``m - s``: monotone in the gap, 0 for gaps below 1/16."""
    u = (m - s) * 16.0
    bits = u.to(tl.int32, bitcast=True)
    j = (bits >> 21) - (127 << 2) + 1
    j = tl.where(u < 1.0, 0, j)
    # a NaN gap (-inf - -inf: a row with no finite value) goes to the last bin; its sign bit
    # is not specified, and a negative one made a negative bin
    j = tl.where(u != u, NB - 1, j)
    return tl.minimum(j, NB - 1)


@triton.jit
def _load_row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab):
    inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row))
    k = tl.load(top_k_ptr + row).to(tl.int64)
    k_on = (k > 0) & (k < vocab)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    return inv_t, k, k_on, p, min_p


@triton.jit
def _row_max(maxima_ptr, row, num_chunks, NCP: tl.constexpr):
    c = tl.arange(0, NCP)
    return tl.max(
        tl.load(maxima_ptr + row * num_chunks + c, mask=c < num_chunks, other=-float("inf"))
    )


@triton.jit
def _load_chunk(logits_ptr, stride, row, chunk, vocab, inv_t, CHUNK: tl.constexpr):
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    s = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
    return s, inside


@triton.jit
def _extremes_kernel(
    logits_ptr, stride, temp_ptr, maxima_ptr, minima_ptr, hist_ptr, z_ptr, t_mp_ptr, count_ptr,
    vocab, num_chunks, CHUNK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row))
    s, inside = _load_chunk(logits_ptr, stride, row, chunk, vocab, inv_t, CHUNK)
    tl.store(maxima_ptr + row * num_chunks + chunk, tl.max(tl.where(inside, s, -float("inf"))))
    tl.store(minima_ptr + row * num_chunks + chunk, tl.min(tl.where(inside, s, float("inf"))))
    if chunk == 0:  # reset the accumulators the next launches add into
        tl.store(hist_ptr + row * NB + tl.arange(0, NB), tl.zeros([NB], tl.int32))
        tl.store(z_ptr + row, tl.zeros([], tl.int64))
        tl.store(count_ptr + row * 4 + tl.arange(0, 4), tl.zeros([4], tl.int32))
        tl.store(t_mp_ptr + row, float("inf"))


@triton.jit
def _histogram_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, hist_ptr, z_ptr,
    t_mp_ptr, vocab, num_chunks, CHUNK: tl.constexpr, NB: tl.constexpr, NCP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    m = _row_max(maxima_ptr, row, num_chunks, NCP)
    s, inside = _load_chunk(logits_ptr, stride, row, chunk, vocab, inv_t, CHUNK)
    hist = tl.histogram(_gap_bin(s, m, NB), NB, mask=inside)
    tl.atomic_add(hist_ptr + row * NB + tl.arange(0, NB), hist)
    need_z = ((k <= 0) | (k >= vocab)) & (p < 1.0)
    if need_z | (min_p > 0.0):
        e = exp_nonpositive(s - m)
        if need_z:
            tl.atomic_add(z_ptr + row, tl.sum(tl.where(inside, fixed_mass(e), 0)))
        if min_p > 0.0:
            t_mp = tl.min(tl.where(inside & (e >= min_p), s, float("inf")))
            tl.atomic_min(t_mp_ptr + row, t_mp)


@triton.jit
def _choose_bins(hist_ptr, row, k, k_on, p, sort_limit, CAP: tl.constexpr, NB: tl.constexpr):
    """(b1, b, c1, total): candidates are the values in bins ``<= b`` (``total`` of them), the
    first tier those in bins ``<= b1`` (``c1``); ``b = -1``: top-k and top-p are off. Integer
    only, so every program of the row computes the same."""
    j = tl.arange(0, NB)
    cum = tl.cumsum(tl.load(hist_ptr + row * NB + j), 0)
    b = tl.full([], -1, tl.int32)
    b1 = tl.full([], -1, tl.int32)
    if k_on:  # the fewest bins holding k values hold every value >= the k-th largest
        b = tl.min(tl.where(cum >= k, j, NB - 1))
        b1 = b
    elif p < 1.0:  # as many as fit: finish_row checks they hold top_p Z
        b = tl.maximum(tl.max(tl.where(cum <= CAP, j, -1)), 0)
        b1 = tl.minimum(tl.max(tl.where(cum <= sort_limit, j, -1)), b)
    total = tl.max(tl.where(j == b, cum, 0))
    c1 = tl.max(tl.where(j == b1, cum, 0))
    return b1, b, c1, total


@triton.jit
def _append(cand_row_ptr, idx_row_ptr, count_ptr, s, cols, chosen, offset,
            STORE_IDX: tl.constexpr):  # fmt: skip
    """Append the chosen values of a chunk (and, with ``STORE_IDX``, their token ids) after
    ``offset`` + the tier's running count."""
    n = tl.sum(chosen.to(tl.int32))
    if n > 0:
        base = offset + tl.atomic_add(count_ptr, n)
        slot = base + tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(cand_row_ptr + slot, s, mask=chosen)
        if STORE_IDX:
            tl.store(idx_row_ptr + slot, cols, mask=chosen)


@triton.jit
def _finish(logits_ptr, stride, cand_ptr, row, vocab, inv_t, k, k_on, p, min_p, maxima_ptr,
            minima_ptr, z_ptr, t_mp_ptr, out_ptr, num_chunks, b1, b, c1, total, sort_limit,
            NCP: tl.constexpr, CAP: tl.constexpr, SORT_CAP: tl.constexpr, BLOCK: tl.constexpr,
            CBLOCK: tl.constexpr, NBLK: tl.constexpr):  # fmt: skip
    m = _row_max(maxima_ptr, row, num_chunks, NCP)
    c = tl.arange(0, NCP)
    row_min = tl.min(
        tl.load(minima_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("inf"))
    )
    cut, from_candidates = finish_row(
        logits_ptr + row.to(tl.int64) * stride, cand_ptr + row.to(tl.int64) * CAP, vocab, inv_t,
        m, row_min, k, k_on, p, min_p, tl.load(z_ptr + row), tl.load(t_mp_ptr + row), b, c1,
        total, sort_limit, CAP, SORT_CAP, BLOCK, CBLOCK, 16, NBLK,
    )  # fmt: skip
    tl.store(out_ptr + row, cut)
    return cut, from_candidates


@triton.jit
def _gather_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, minima_ptr,
    hist_ptr, z_ptr, t_mp_ptr, count_ptr, cand_ptr, idx_ptr, out_ptr, vocab, num_chunks,
    sort_limit, CHUNK: tl.constexpr, GATHER_BLOCK: tl.constexpr, NB: tl.constexpr,
    NCP: tl.constexpr, CAP: tl.constexpr, SORT_CAP: tl.constexpr, BLOCK: tl.constexpr,
    CBLOCK: tl.constexpr, NBLK: tl.constexpr, FUSED: tl.constexpr, STORE_IDX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    b1, b, c1, total = _choose_bins(hist_ptr, row, k, k_on, p, sort_limit, CAP, NB)
    if (b >= 0) & (total <= CAP):
        m = _row_max(maxima_ptr, row, num_chunks, NCP)
        # a chunk whose max lies past the last candidate bin holds no candidate: skip its loads
        if _gap_bin(tl.load(maxima_ptr + row * num_chunks + chunk), m, NB) <= b:
            cand_row_ptr = cand_ptr + row.to(tl.int64) * CAP
            idx_row_ptr = idx_ptr + row.to(tl.int64) * CAP
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            # blocked (not whole-chunk) loads: the appends' cumsums over a whole chunk cost
            # registers and ran slower than the blocked loop on the H200
            for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, GATHER_BLOCK):
                cols = start + tl.arange(0, GATHER_BLOCK)
                inside = cols < vocab
                s = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
                bins = _gap_bin(s, m, NB)
                first = inside & (bins <= b1)
                second = inside & (bins > b1) & (bins <= b)
                _append(cand_row_ptr, idx_row_ptr, count_ptr + row * 4, s, cols, first, 0,
                        STORE_IDX)  # fmt: skip
                _append(cand_row_ptr, idx_row_ptr, count_ptr + row * 4 + 1, s, cols, second,
                        c1, STORE_IDX)  # fmt: skip
    if FUSED:  # the row's last program to get here finishes it
        tl.debug_barrier()  # every thread's candidate stores precede the release below
        if tl.atomic_add(count_ptr + row * 4 + 2, 1, sem="acq_rel") == num_chunks - 1:
            _finish(logits_ptr, stride, cand_ptr, row, vocab, inv_t, k, k_on, p, min_p,
                    maxima_ptr, minima_ptr, z_ptr, t_mp_ptr, out_ptr, num_chunks, b1, b, c1,
                    total, sort_limit, NCP, CAP, SORT_CAP, BLOCK, CBLOCK, NBLK)  # fmt: skip


@triton.jit
def _finish_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, minima_ptr,
    hist_ptr, z_ptr, t_mp_ptr, cand_ptr, out_ptr, vocab, num_chunks, sort_limit,
    NB: tl.constexpr, NCP: tl.constexpr, CAP: tl.constexpr, SORT_CAP: tl.constexpr,
    BLOCK: tl.constexpr, CBLOCK: tl.constexpr, NBLK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    b1, b, c1, total = _choose_bins(hist_ptr, row, k, k_on, p, sort_limit, CAP, NB)
    _finish(logits_ptr, stride, cand_ptr, row, vocab, inv_t, k, k_on, p, min_p, maxima_ptr,
            minima_ptr, z_ptr, t_mp_ptr, out_ptr, num_chunks, b1, b, c1, total, sort_limit,
            NCP, CAP, SORT_CAP, BLOCK, CBLOCK, NBLK)  # fmt: skip


def _row_floats(t: torch.Tensor, rows: int, name: str, device) -> torch.Tensor:
    if t.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.float32).contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chunking(vocab: int, max_chunks: int = _MAX_CHUNKS) -> tuple[int, int]:
    """(chunk, number of chunks): a function of the vocabulary only (batch invariance)."""
    chunk = max(64, min(4096, _pow2_at_least(_cdiv(vocab, max_chunks))))
    return chunk, _cdiv(vocab, chunk)


@functools.lru_cache(maxsize=64)
def _plan(vocab: int, cap: int, sort_cap: int, max_chunks: int) -> tuple[int, int, dict]:
    """(chunk, number of chunks, the finishing constexprs) for a vocabulary and knob setting:
    computed once (this host work is inside every sampling step)."""
    if sort_cap > cap or cap & (cap - 1) or max_chunks < 1:
        raise ValueError(
            f"cutoff knobs: expected power-of-2 cap >= sort_cap and max_chunks >= 1, got "
            f"cap={cap}, sort_cap={sort_cap}, max_chunks={max_chunks}"
        )
    chunk, num_chunks = chunking(vocab, max_chunks)
    slow_block = min(1024, max(64, _pow2_at_least(_cdiv(vocab, 8))))
    finish = dict(
        NCP=_pow2_at_least(num_chunks), CAP=cap, SORT_CAP=_pow2_at_least(max(sort_cap, 2)),
        BLOCK=slow_block, CBLOCK=min(_CAND_BLOCK, cap),
        NBLK=_pow2_at_least(_cdiv(vocab, slow_block)), num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return chunk, num_chunks, finish


def check_filters(logits, temperature, top_k, top_p, min_p):
    """The per-row filters as contiguous tensors on the logits' device (float32, top_k as
    given), after checking the shapes."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with unit column stride, got {logits.shape}")
    rows = logits.shape[0]
    device = logits.device
    temperature = _row_floats(temperature, rows, "temperature", device)
    if top_k.shape != (rows,):
        raise ValueError(f"top_k: expected shape ({rows},), got {tuple(top_k.shape)}")
    top_k = top_k.to(device=device).contiguous()
    return (
        temperature,
        top_k,
        _row_floats(top_p, rows, "top_p", device),
        _row_floats(min_p, rows, "min_p", device),
    )


class Passes(NamedTuple):
    """The buffers the first three launches filled, for the finishing launch."""

    head: tuple  # (logits, row stride, temperature)
    params: tuple  # (top_k, top_p, min_p)
    buffers: tuple  # (maxima, minima, hist, z, t_mp)
    cand: torch.Tensor  # [B * cap] float32 candidate values
    idx: torch.Tensor | None  # [B * cap] int32 their token ids (when asked)
    out: torch.Tensor  # [B] float32: the cutoffs, once finished


def first_passes(logits, filters, cap, sort_cap, max_chunks, *, fused_finish=False,
                 store_idx=False) -> Passes:  # fmt: skip
    """Launch the extremes, histogram and gather passes (see the module docstring)."""
    rows, vocab = logits.shape
    device = logits.device
    chunk, num_chunks, tail = _plan(vocab, cap, sort_cap, max_chunks)
    # a few allocations, cut into flat per-row arrays
    f32 = torch.empty(rows * (2 * num_chunks + 2 + cap), dtype=torch.float32, device=device)
    maxima, minima, t_mp, out, cand = f32.split(
        [rows * num_chunks, rows * num_chunks, rows, rows, rows * cap]
    )
    i32 = torch.empty(rows * (NUM_BINS + 4 + cap * store_idx), dtype=torch.int32, device=device)
    hist, count, idx = i32.split([rows * NUM_BINS, rows * 4, rows * cap * store_idx])
    z = torch.empty(rows, dtype=torch.int64, device=device)
    head = (logits, logits.stride(0), filters[0])
    params = filters[1:]
    grid = (rows, num_chunks)
    _extremes_kernel[grid](*head, maxima, minima, hist, z, t_mp, count, vocab, num_chunks,
                           CHUNK=chunk, NB=NUM_BINS, num_warps=8, enable_fp_fusion=False)  # fmt: skip
    _histogram_kernel[grid](*head, *params, maxima, hist, z, t_mp, vocab, num_chunks,
                            CHUNK=chunk, NB=NUM_BINS, NCP=tail["NCP"], num_warps=8,
                            enable_fp_fusion=False)  # fmt: skip
    _gather_kernel[grid](*head, *params, maxima, minima, hist, z, t_mp, count, cand,
                         idx if store_idx else cand, out, vocab, num_chunks, sort_cap,
                         CHUNK=chunk, GATHER_BLOCK=min(chunk, _GATHER_BLOCK), NB=NUM_BINS,
                         FUSED=fused_finish, STORE_IDX=store_idx, **tail)  # fmt: skip
    buffers = (maxima, minima, hist, z, t_mp)
    return Passes(head, params, buffers, cand, idx if store_idx else None, out)


def cutoff(logits, temperature, top_k, top_p, min_p, *, cap: int = DEFAULT_CAP,
           sort_cap: int = DEFAULT_SORT_CAP, max_chunks: int = _MAX_CHUNKS,
           fused_finish: bool = False):  # fmt: skip
    """:func:`deepinfer.kernels.top_k_top_p_min_p_cutoff` with its tuning knobs (powers of 2):
    ``cap`` candidates per row before the whole-row search, ``sort_cap`` candidates sorted in
    registers (0: never), ``max_chunks`` programs per row, ``fused_finish`` (the gather's last
    program per row finishes it: one launch less). Every setting gives the same result; tests
    shrink them to drive rows down each path, benchmarks sweep them."""
    filters = check_filters(logits, temperature, top_k, top_p, min_p)
    passes = first_passes(logits, filters, cap, sort_cap, max_chunks, fused_finish=fused_finish)
    if not fused_finish:
        rows, vocab = logits.shape
        _, num_chunks, tail = _plan(vocab, cap, sort_cap, max_chunks)
        _finish_kernel[(rows,)](*passes.head, *passes.params, *passes.buffers, passes.cand,
                                passes.out, vocab, num_chunks, sort_cap, NB=NUM_BINS,
                                **tail)  # fmt: skip
    return passes.out


@implements("top_k_top_p_min_p_cutoff")
def top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p):
    return cutoff(logits, temperature, top_k, top_p, min_p)
