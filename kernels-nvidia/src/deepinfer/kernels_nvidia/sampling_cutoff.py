"""The top-k / top-p / min-p cutoff in Triton, spread over the whole GPU.

Every filter keeps the values at or above a threshold, so the answer is one value per row. The
row is cut into chunks (grid ``(rows, chunks)``, the chunk size a function of the vocabulary
only) and four launches find it:

1. ``_extremes_kernel``: per chunk, the max and min of ``s = logits * (1 / T)``.
2. ``_histogram_kernel``: per row, a histogram of the gap ``m - s`` to the row max ``m`` in
   bins of ~19% width (4 per octave; integer atomics, so order independent); for rows that need
   them, the exact int64 mass ``Z = sum trunc(exp(s - m) 2**40)`` and the min-p threshold.
3. ``_gather_kernel``: the first bins that hold the top-k (``count >= k``), or for top-p alone a
   provable lower bound of mass ``>= top_p Z``, are the candidates: an upper set of values that
   holds every kept token. Each chunk appends its candidates to a per-row buffer.
4. ``_finish_kernel``: one program per row sorts its <= ``cap`` candidates and reads the top-k
   value, the exact top-p cut (int64 prefix masses) and the min-p threshold off them. A row
   whose candidates overflow ``cap`` takes the slow exact path (``sampling_cutoff_search``).

Masses are exact integer sums, so the result never depends on the summation order, the batch or
the device: it is bit-identical to the reference twin. The candidates' append order varies run
to run; the sort makes it irrelevant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements
from deepinfer.kernels_nvidia.sampling_cutoff_search import (
    exp_nonpositive,
    fixed_mass,
    search_cutoff,
)

NUM_BINS = 64  # bin 0: gap < 1/16; then 4 bins per octave up to ~4000 nats; the last: the rest
GAP_SCALE = 16.0
SUB_BITS = 2  # log2(bins per octave)
DEFAULT_CAP = 8192  # candidates searched by the finishing program
_CAND_BLOCK = 256
DEFAULT_SORT_CAP = 1024  # candidates sorted in registers instead of searched
_MAX_CHUNKS = 32


@triton.jit
def _gap_bin(s, m, NB: tl.constexpr):
    """Histogram bin of ``m - s``: monotone in the gap, 0 for gaps below 1/16."""
    u = (m - s) * 16.0
    bits = u.to(tl.int32, bitcast=True)
    j = (bits >> 21) - (127 << 2) + 1
    j = tl.where(u < 1.0, 0, j)
    return tl.minimum(j, NB - 1)


@triton.jit
def _bin_mass_floor(j, NB: tl.constexpr):
    """A lower bound (1% slack) of the fixed-point mass ``exp(s - m) 2**40`` of any value in bin
    ``j``; 0 in the last bin. Elementwise, so every kernel computes the same integers."""
    octave = (tl.maximum(j, 1) - 1) >> 2
    quarter = (tl.maximum(j, 1) - 1) & 3
    gap_hi = tl.exp2(octave.to(tl.float32)) * (1.0 + (quarter + 1).to(tl.float32) * 0.25) / 16.0
    gap_hi = tl.where(j == 0, 1.0 / 16.0, gap_hi)
    floor = (tl.exp(-gap_hi) * (0.99 * 1099511627776.0)).to(tl.int64)
    return tl.where(j == NB - 1, 0, floor)


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
def _extremes_kernel(
    logits_ptr, stride, temp_ptr, maxima_ptr, minima_ptr, hist_ptr, z_ptr, t_mp_ptr, count_ptr,
    vocab, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row))
    hi = tl.full([BLOCK], -float("inf"), tl.float32)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
        hi = tl.maximum(hi, tl.where(inside, s, -float("inf")))
        lo = tl.minimum(lo, tl.where(inside, s, float("inf")))
    tl.store(maxima_ptr + row * num_chunks + chunk, tl.max(hi))
    tl.store(minima_ptr + row * num_chunks + chunk, tl.min(lo))
    if chunk == 0:  # reset the accumulators the next launches add into
        tl.store(hist_ptr + row * NB + tl.arange(0, NB), tl.zeros([NB], tl.int32))
        tl.store(z_ptr + row, tl.zeros([], tl.int64))
        tl.store(count_ptr + row, tl.zeros([], tl.int32))
        tl.store(t_mp_ptr + row, float("inf"))


@triton.jit
def _histogram_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, hist_ptr, z_ptr,
    t_mp_ptr, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NCP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    m = _row_max(maxima_ptr, row, num_chunks, NCP)
    need_z = ((k <= 0) | (k >= vocab)) & (p < 1.0)
    need_mass = need_z | (min_p > 0.0)
    hist = tl.zeros([NB], tl.int32)
    z = tl.zeros([BLOCK], tl.int64)
    t_mp = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
        hist += tl.histogram(_gap_bin(s, m, NB), NB, mask=inside)
        if need_mass:
            e = exp_nonpositive(s - m)
            z += tl.where(inside, fixed_mass(e), 0)
            t_mp = tl.minimum(t_mp, tl.where(inside & (e >= min_p), s, float("inf")))
    tl.atomic_add(hist_ptr + row * NB + tl.arange(0, NB), hist)
    if need_z:
        tl.atomic_add(z_ptr + row, tl.sum(z))
    if min_p > 0.0:
        tl.atomic_min(t_mp_ptr + row, tl.min(t_mp))


@triton.jit
def _choose_bin(hist_ptr, z_ptr, row, k, k_on, p, vocab, NB: tl.constexpr):
    """The last candidate bin ``b`` (-1: no top-k / top-p, so no candidates) and the number of
    values in bins ``<= b``. Deterministic: every program of the row computes the same."""
    j = tl.arange(0, NB)
    hist = tl.load(hist_ptr + row * NB + j)
    cum = tl.cumsum(hist, 0)
    b = tl.full([], -1, tl.int32)
    if k_on:  # the first bins holding k values hold every value >= the k-th largest
        b = tl.min(tl.where(cum >= k, j, NB - 1))
    elif p < 1.0:  # the first bins whose mass provably reaches p Z hold every kept value
        # integer prefix sums: exact, so every program (whatever its layout) picks the same bin;
        # + vocab covers the truncation of each fixed-point term
        floor_mass = tl.cumsum(hist.to(tl.int64) * _bin_mass_floor(j, NB), 0)
        z = tl.load(z_ptr + row).to(tl.float64)
        target = p.to(tl.float64) * z * 1.0001 + vocab
        b = tl.min(tl.where(floor_mass.to(tl.float64) >= target, j, NB - 1))
    count = tl.max(tl.where(j == b, cum, 0))
    return b, count


@triton.jit
def _gather_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, hist_ptr, z_ptr,
    count_ptr, cand_ptr, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NCP: tl.constexpr,
    CAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    b, total = _choose_bin(hist_ptr, z_ptr, row, k, k_on, p, vocab, NB)
    if (b >= 0) & (total <= CAP):
        m = _row_max(maxima_ptr, row, num_chunks, NCP)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            s = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
            chosen = inside & (_gap_bin(s, m, NB) <= b)
            n = tl.sum(chosen.to(tl.int32))
            if n > 0:
                base = tl.atomic_add(count_ptr + row, n)
                slot = base + tl.cumsum(chosen.to(tl.int32), 0) - 1
                tl.store(cand_ptr + row.to(tl.int64) * CAP + slot, s, mask=chosen)


@triton.jit
def _cut_from_sorted(cand_ptr, count, m, k, k_on, p, z_full, SORT_CAP: tl.constexpr):
    """max(top-k value, top-p cut) read off the <= SORT_CAP candidates sorted in registers: the
    k-th value, and the last value whose exclusive prefix mass is < top_p Z_k."""
    idx = tl.arange(0, SORT_CAP)
    valid = idx < count
    v = tl.sort(tl.load(cand_ptr + idx, mask=valid, other=-float("inf")), 0, descending=True)
    t_k = tl.full([], -float("inf"), tl.float32)
    if k_on:
        t_k = tl.max(tl.where(idx == k - 1, v, -float("inf")))
    in_k = valid & (v >= t_k)
    e_k = tl.where(in_k, fixed_mass(exp_nonpositive(v - m)), 0)
    t_p = tl.full([], -float("inf"), tl.float32)
    if p < 1.0:
        z = z_full
        if k_on:
            z = tl.sum(e_k)
        exclusive = tl.cumsum(e_k, 0) - e_k
        target = p.to(tl.float64) * z.to(tl.float64)
        num_kept = tl.sum((in_k & (exclusive.to(tl.float64) < target)).to(tl.int32))
        t_p = tl.max(tl.where(idx == num_kept - 1, v, -float("inf")))
    return tl.maximum(t_k, t_p)


@triton.jit
def _finish_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, minima_ptr,
    hist_ptr, z_ptr, t_mp_ptr, count_ptr, cand_ptr, out_ptr, vocab, num_chunks, sort_limit,
    NB: tl.constexpr, NCP: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
    NP: tl.constexpr, NBLK: tl.constexpr, CBLOCK: tl.constexpr, SORT_CAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    m = _row_max(maxima_ptr, row, num_chunks, NCP)
    c = tl.arange(0, NCP)
    row_min = tl.min(
        tl.load(minima_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("inf"))
    )
    b, total = _choose_bin(hist_ptr, z_ptr, row, k, k_on, p, vocab, NB)
    cut = tl.full([], -float("inf"), tl.float32)
    if b >= 0:
        z_full = tl.load(z_ptr + row)
        cand_row_ptr = cand_ptr + row.to(tl.int64) * CAP
        if total <= sort_limit:  # few: sort them in registers
            cut = _cut_from_sorted(cand_row_ptr, total, m, k, k_on, p, z_full, SORT_CAP)
        elif total <= CAP:  # search the candidates (already scaled)
            cut = search_cutoff(cand_row_ptr, total, 1.0, m, k, k_on, p, z_full,
                                CBLOCK, NP, CAP // CBLOCK, False)  # fmt: skip
        else:  # too many: search the whole row
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            cut = search_cutoff(row_ptr, vocab, inv_t, m, k, k_on, p, z_full, BLOCK, NP, NBLK, True)
    if min_p > 0.0:
        cut = tl.maximum(cut, tl.load(t_mp_ptr + row))
    tl.store(out_ptr + row, tl.where(cut <= row_min, -float("inf"), cut))


def _row_floats(t: torch.Tensor, rows: int, name: str, device) -> torch.Tensor:
    if t.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.float32).contiguous()


def chunking(vocab: int, max_chunks: int = _MAX_CHUNKS) -> tuple[int, int, int]:
    """(chunk, block, number of chunks): a function of the vocabulary only (batch invariance)."""
    chunk = max(64, min(4096, triton.next_power_of_2(triton.cdiv(vocab, max_chunks))))
    return chunk, min(1024, chunk), triton.cdiv(vocab, chunk)


def cutoff(logits, temperature, top_k, top_p, min_p, *, cap: int = DEFAULT_CAP,
           sort_cap: int = DEFAULT_SORT_CAP, max_chunks: int = _MAX_CHUNKS):  # fmt: skip
    """:func:`deepinfer.kernels.top_k_top_p_min_p_cutoff` with its tuning knobs (powers of 2):
    ``cap`` candidates per row before the whole-row search, ``sort_cap`` candidates sorted in
    registers (0: never), ``max_chunks`` programs per row. Every setting gives the same result;
    tests shrink them to drive rows down each path, benchmarks sweep them."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with unit column stride, got {logits.shape}")
    if sort_cap > cap:
        raise ValueError(f"sort_cap: expected <= cap ({cap}), got {sort_cap}")
    rows, vocab = logits.shape
    device = logits.device
    temperature = _row_floats(temperature, rows, "temperature", device)
    if top_k.shape != (rows,):
        raise ValueError(f"top_k: expected shape ({rows},), got {tuple(top_k.shape)}")
    top_k = top_k.to(device=device).contiguous()
    top_p = _row_floats(top_p, rows, "top_p", device)
    min_p = _row_floats(min_p, rows, "min_p", device)
    chunk, block, num_chunks = chunking(vocab, max_chunks)
    ncp = triton.next_power_of_2(num_chunks)
    f32 = dict(dtype=torch.float32, device=device)
    maxima, minima = torch.empty(rows, num_chunks, **f32), torch.empty(rows, num_chunks, **f32)
    hist = torch.empty(rows, NUM_BINS, dtype=torch.int32, device=device)
    z = torch.empty(rows, dtype=torch.int64, device=device)
    t_mp, out = torch.empty(rows, **f32), torch.empty(rows, **f32)
    count = torch.empty(rows, dtype=torch.int32, device=device)
    cand = torch.empty(rows, cap, **f32)
    row_args = (logits, logits.stride(0), temperature)
    params = (top_k, top_p, min_p)
    grid = (rows, num_chunks)
    common = dict(enable_fp_fusion=False)
    _extremes_kernel[grid](*row_args, maxima, minima, hist, z, t_mp, count, vocab, num_chunks,
                           CHUNK=chunk, BLOCK=block, NB=NUM_BINS, num_warps=8, **common)  # fmt: skip
    _histogram_kernel[grid](*row_args, *params, maxima, hist, z, t_mp, vocab, num_chunks,
                            CHUNK=chunk, BLOCK=block, NB=NUM_BINS, NCP=ncp, num_warps=8,
                            **common)  # fmt: skip
    _gather_kernel[grid](*row_args, *params, maxima, hist, z, count, cand, vocab, num_chunks,
                         CHUNK=chunk, BLOCK=block, NB=NUM_BINS, NCP=ncp, CAP=cap, num_warps=8,
                         **common)  # fmt: skip
    slow_block = min(1024, max(64, triton.next_power_of_2(triton.cdiv(vocab, 8))))
    _finish_kernel[(rows,)](*row_args, *params, maxima, minima, hist, z, t_mp, count, cand, out,
                            vocab, num_chunks, sort_cap, NB=NUM_BINS, NCP=ncp, CAP=cap, BLOCK=slow_block,
                            NP=16, NBLK=triton.next_power_of_2(triton.cdiv(vocab, slow_block)),
                            CBLOCK=min(_CAND_BLOCK, cap), SORT_CAP=max(sort_cap, 2),
                            num_warps=8, **common)  # fmt: skip
    return out


@implements("top_k_top_p_min_p_cutoff")
def top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p):
    return cutoff(logits, temperature, top_k, top_p, min_p)
