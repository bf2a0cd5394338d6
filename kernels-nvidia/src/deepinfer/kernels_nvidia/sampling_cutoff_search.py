"""Per-row finishing of the cutoff: the bit-exact ``exp``, fixed-point masses, and the three
exact ways to read the cut once the candidates are gathered (``finish_row``):

* few candidates (``<= sort_limit``): sorted in registers; the top-k value is the k-th, the
  top-p cut the last value whose exclusive prefix mass is ``< top_p Z_k``;
* more (``<= cap``): a search over the candidate buffer;
* too many, or (top-p alone) candidates holding less than ``top_p Z``: a search over the row.

A search is 16-ary over the order-preserving integer keys of float32 values, snapping the bracket
to set values after each pass (so at most 8 passes). Top-k searches for the smallest ``x`` with
``count(s > x) < k``, top-p for the smallest ``x`` with ``mass(s > x, s >= t_k) < top_p Z_k``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exp_nonpositive(x):
    """``deepinfer.kernels.reference.sampling.exp_nonpositive`` op for op (compile with
    ``enable_fp_fusion=False`` so no multiply-add is contracted): bit-identical results."""
    xc = tl.maximum(x, -87.0)
    n = tl.floor(xc * 1.4426950216293335 + 0.5)
    r = (xc - n * 0.693359375) - n * -0.00021219444170128554
    poly = r * 0.00019841270113829523 + 0.0013888889225199819
    poly = poly * r + 0.008333333767950535
    poly = poly * r + 0.0416666679084301
    poly = poly * r + 0.1666666716337204
    poly = poly * r + 0.5
    poly = poly * r + 1.0
    poly = poly * r + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < -87.0, 0.0, poly * scale)


@triton.jit
def fixed_mass(e):
    """int64 ``trunc(e * 2**40)``: masses summed exactly, in any order."""
    return (e * 1099511627776.0).to(tl.int64)


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
def _load_scaled(row_ptr, cols, vocab, inv_t):
    # .cg (L2, not L1): with a fused finish the candidates were stored by other programs of
    # the same launch
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"), cache_modifier=".cg")
    return x.to(tl.float32) * inv_t


@triton.jit
def _stats_above(row_ptr, vocab, inv_t, m, t_k, pivots, IS_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Per pivot: the count (or top-k-restricted fixed-point mass) of values strictly above it,
    the smallest value above it and the largest value at or below it."""
    acc = tl.zeros(pivots.shape, dtype=tl.int64)
    next_above = tl.full(pivots.shape, float("inf"), tl.float32)
    last_below = tl.full(pivots.shape, float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        s = _load_scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
        if IS_MASS:
            w = tl.where(s >= t_k, fixed_mass(exp_nonpositive(s - m)), 0)
        else:
            w = tl.full([BLOCK], 1, tl.int64)
        above = s[:, None] > pivots[None, :]
        acc += tl.sum(tl.where(above, w[:, None], 0), axis=0)
        s2 = s[:, None] + tl.zeros_like(pivots)[None, :]
        next_above = tl.minimum(next_above, tl.min(tl.where(above, s2, float("inf")), axis=0))
        last_below = tl.maximum(last_below, tl.max(tl.where(above, float("-inf"), s2), axis=0))
    return acc, next_above, last_below


@triton.jit
def _search(row_ptr, vocab, inv_t, m, t_k, target, lo, hi,
            IS_MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):  # fmt: skip
    """Smallest key in [lo, hi] whose stat is < target (float64). The stat is non-increasing in
    the key, true at ``hi`` and changes only at row values, so the answer is ``lo`` or a row
    value: each pass evaluates NP pivots and snaps the bracket to the row values around the
    first true one."""
    j = tl.arange(0, NP).to(tl.int64)
    while lo < hi:
        pivot_keys = lo + ((hi - lo) * j) // NP
        stats, next_above, last_below = _stats_above(
            row_ptr, vocab, inv_t, m, t_k, _key_to_float(pivot_keys), IS_MASS, BLOCK
        )
        first = tl.min(tl.where(stats.to(tl.float64) < target, j, NP))
        if first == 0:
            hi = lo
        else:
            lo = _float_to_key(tl.max(tl.where(j == first - 1, next_above, float("-inf"))))
            if first < NP:
                hi = _float_to_key(tl.max(tl.where(j == first, last_below, float("-inf"))))
    return _key_to_float(lo)


@triton.jit
def _k_bound(row_ptr, vocab, inv_t, k, BLOCK: tl.constexpr, NBLK: tl.constexpr):
    """A lower bound on the k-th largest value: the k-th largest of the per-block maxima (k
    blocks hold a value at least that large); -inf when k > NBLK."""
    ids = tl.arange(0, NBLK)
    maxima = tl.full([NBLK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        s = _load_scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
        maxima = tl.where(ids == start // BLOCK, tl.max(s), maxima)
    ordered = tl.sort(maxima, descending=True)
    return tl.max(tl.where(ids.to(tl.int64) == k - 1, ordered, float("-inf")))


@triton.jit
def _mass_and_smallest(row_ptr, vocab, inv_t, m, threshold, BLOCK: tl.constexpr):
    """Fixed-point mass of the values >= threshold, and the smallest of them."""
    mass = tl.zeros([BLOCK], tl.int64)
    smallest = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        s = _load_scaled(row_ptr, start + tl.arange(0, BLOCK), vocab, inv_t)
        kept = s >= threshold
        mass += tl.where(kept, fixed_mass(exp_nonpositive(s - m)), 0)
        smallest = tl.minimum(smallest, tl.where(kept, s, float("inf")))
    return tl.sum(mass), tl.min(smallest)


@triton.jit
def search_cutoff(row_ptr, n, inv_t, m, k, k_on, p, z_full, BLOCK: tl.constexpr,
                  NP: tl.constexpr, NBLK: tl.constexpr, WHOLE_ROW: tl.constexpr):  # fmt: skip
    """max(top-k value, top-p cut) over the ``n`` values at ``row_ptr`` (times ``inv_t``): a
    whole row, or an upper set of it that holds every kept value and, when top-k is on, at
    least k values. ``z_full``: the row's fixed-point mass, the top-p total when top-k is off.
    ``WHOLE_ROW``: the set is the whole row (so the top-p search may start at a mass bound).
    Returns a value of the set (-inf when neither filter is on)."""
    hi = _float_to_key(m)
    t_k = tl.full([], float("-inf"), tl.float32)
    if k_on:
        lo_k = _float_to_key(_k_bound(row_ptr, n, inv_t, k, BLOCK, NBLK))
        t_k = _search(row_ptr, n, inv_t, m, t_k, k.to(tl.float64), lo_k, hi,
                      False, BLOCK, NP)  # fmt: skip
    t_p = tl.full([], float("-inf"), tl.float32)
    if p < 1.0:
        z_k = z_full
        if k_on:
            z_k, _ = _mass_and_smallest(row_ptr, n, inv_t, m, t_k, BLOCK)
        lo_p = _float_to_key(t_k)  # kept values are top-k survivors
        if WHOLE_ROW:
            # Values with e < tau = (1 - p) Z_k / (4 V) hold less than (1 - p) Z_k / 4 in total,
            # so the mass above each exceeds p Z_k: the top-p cut is at least m + log(tau).
            # (Not on a candidate subset without top-k: its mass may exceed p Z by less.)
            z_real = z_k.to(tl.float32) * (1.0 / 1099511627776.0)
            p_bound = m + tl.log((1.0 - p) * z_real / (4.0 * n))
            lo_p = tl.maximum(lo_p, _float_to_key(p_bound))
        target = p.to(tl.float64) * z_k.to(tl.float64)
        t_p = _search(row_ptr, n, inv_t, m, t_k, target, lo_p, hi, True, BLOCK, NP)
    _, cut = _mass_and_smallest(row_ptr, n, inv_t, m, tl.maximum(t_k, t_p), BLOCK)
    return cut


@triton.jit
def _cut_from_sorted(cand_ptr, count, m, k, k_on, p, z_full, SORT_CAP: tl.constexpr):
    """(max(top-k value, top-p cut), ok) from the <= SORT_CAP candidates sorted in registers.
    ``ok`` is False when top-p alone needs values outside them (their mass is < top_p Z)."""
    idx = tl.arange(0, SORT_CAP)
    valid = idx < count
    x = tl.load(cand_ptr + idx, mask=valid, other=-float("inf"), cache_modifier=".cg")
    v = tl.sort(x, 0, descending=True)
    t_k = tl.full([], -float("inf"), tl.float32)
    if k_on:
        t_k = tl.max(tl.where(idx == k - 1, v, -float("inf")))
    in_k = valid & (v >= t_k)
    e_k = tl.where(in_k, fixed_mass(exp_nonpositive(v - m)), 0)
    t_p = tl.full([], -float("inf"), tl.float32)
    ok = tl.full([], 1, tl.int1)
    if p < 1.0:
        z = z_full
        if k_on:
            z = tl.sum(e_k)
        target = p.to(tl.float64) * z.to(tl.float64)
        ok = k_on | (tl.sum(e_k).to(tl.float64) >= target)
        exclusive = tl.cumsum(e_k, 0) - e_k
        num_kept = tl.sum((in_k & (exclusive.to(tl.float64) < target)).to(tl.int32))
        t_p = tl.max(tl.where(idx == num_kept - 1, v, -float("inf")))
    return tl.maximum(t_k, t_p), ok


@triton.jit
def finish_row(row_ptr, cand_row_ptr, vocab, inv_t, m, row_min, k, k_on, p, min_p, z_full, t_mp,
               b, c1, total, sort_limit, CAP: tl.constexpr, SORT_CAP: tl.constexpr,
               BLOCK: tl.constexpr, CBLOCK: tl.constexpr, NP: tl.constexpr,
               NBLK: tl.constexpr):  # fmt: skip
    """(cut, from_candidates): the row's cutoff from its gathered candidates, ``c1`` sort-tier
    values then up to ``total`` in all (``b < 0``: top-k and top-p are off), -inf when every
    token is kept; ``from_candidates`` when the cut was read off the candidates, which then hold
    every kept token (they are an upper set of the row, and the cut is one of them)."""
    cut = tl.full([], -float("inf"), tl.float32)
    searched_row = tl.full([], 0, tl.int1)
    if b >= 0:
        done = tl.full([], 0, tl.int1)
        if (c1 > 0) & (c1 <= sort_limit):
            cut, done = _cut_from_sorted(cand_row_ptr, c1, m, k, k_on, p, z_full, SORT_CAP)
        if done == 0:
            whole_row = total > CAP
            if ((k <= 0) | (k >= vocab)) & (total <= CAP):  # top-p alone: enough mass?
                u_mass, _ = _mass_and_smallest(cand_row_ptr, total, 1.0, m, -float("inf"), CBLOCK)
                whole_row = u_mass.to(tl.float64) < p.to(tl.float64) * z_full.to(tl.float64)
            if whole_row:
                cut = search_cutoff(row_ptr, vocab, inv_t, m, k, k_on, p, z_full,
                                    BLOCK, NP, NBLK, True)  # fmt: skip
                searched_row = tl.full([], 1, tl.int1)
            else:
                cut = search_cutoff(cand_row_ptr, total, 1.0, m, k, k_on, p, z_full,
                                    CBLOCK, NP, CAP // CBLOCK, False)  # fmt: skip
    if min_p > 0.0:
        cut = tl.maximum(cut, t_mp)
    return tl.where(cut <= row_min, -float("inf"), cut), (b >= 0) & (searched_row == 0)
