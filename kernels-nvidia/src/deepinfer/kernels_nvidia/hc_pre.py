"""mHC pre stage in ONE pass over the streams (4 streams): the coefficients (RMS, projection,
sigmoid heads, Sinkhorn) fused with the collapse ``y = sum_j p[j] h[j]``.

A program owns ``BT`` tokens x ``DC`` columns of each of the 4 streams and keeps them in
registers. It writes its partial projection (fp32, the 3-term bf16 split of :mod:`.hc` on the
tensor cores) with the partial sum of squares, then arrives at its tile's counter. The LAST
program to arrive adds the tile's partials (one tree sum over chunks in a fixed order) and
finishes ``pre``, ``post`` and ``comb`` for the tile.

Two collapse weights ``p``:

- ``collapse_pre`` given (V4.1's deferred pre-mix: the collapse uses the previous site's
  weights): nobody waits; every program collapses its own columns at once.
- V4 (``p = pre`` of the same streams): the last arriver publishes ``pre`` and bumps the counter
  once more; the others wait for that (a volatile poll with a ``nanosleep`` backoff), read the
  ``BT x 4`` weights and collapse the columns they hold. A waiting program only needs the other
  chunks of its own tile, whose program ids are adjacent (chunk is the fastest grid index) and
  dispatched before any later tile's, so the lowest unfinished tile always runs.

Under the Triton interpreter (CPU tensors) programs run one after another, so in the V4 mode a
tile is one program there (``DC`` covers ``D``) and nothing waits.

Chunking depends only on ``D`` (never on ``T``), and a token's sums never mix rows, so results
are batch invariant; they equal ``hc_mix_coefficients`` + ``hc_collapse`` up to fp32 summation
order (different chunking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.hc import _split_dot
from deepinfer.kernels_nvidia.registry import implements

NC_FUSED = 4  # streams the fused kernel handles (V4 / V4.1 hc_mult)
# Partial columns: 0..3 pre mixes, 4 the sum of squares (what the collapse waits for: one group
# of 8), 8..11 post, 12..27 comb; 5..7 and 28..31 zero.
NPAD = tl.constexpr(32)
SQ_COL = tl.constexpr(4)
POST_COL = tl.constexpr(8)
COMB_COL = tl.constexpr(12)


@dataclass(frozen=True)
class HcPreTiles:
    """Tokens per tile, stream columns per program, warps (the launch shape)."""

    block_tokens: int = 32
    block_cols: int = 128
    num_warps: int = 4


@dataclass(frozen=True)
class HcPreSync:
    """How a V4-mode program waits (benchmark sweeps; the defaults are the measured best).

    wait: 0 = never (WRONG results, a timing floor), 1 = volatile loads, 2 = atomic reads.
    sleep_ns: ``nanosleep`` between polls (0 = spin). counter_stride: int32 slots between tiles'
    counters (32 = one 128-byte line each). all_reduce: every program adds the tile's partials
    itself (the first design) instead of reading the last arriver's ``pre``. reread: waiters load
    their columns again (L2) after the wait instead of holding them in registers.
    """

    wait: int = 1
    sleep_ns: int = 64
    counter_stride: int = 32
    all_reduce: bool = False
    reread: bool = False


DEFAULT_TILES = HcPreTiles()
DEFAULT_SYNC = HcPreSync()


@triton.jit
def _now(anchor):
    """%globaltimer in ns (trace only)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _smid(anchor):
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [anchor], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _nap(seen, ns):
    """``seen`` unchanged after sleeping about ``ns`` nanoseconds."""
    return tl.inline_asm_elementwise(
        "nanosleep.u32 $2;\n\tmov.b32 $0, $1;", "=r,r,r", [seen, ns], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _wait_until(count_ptr, target, seen, WAIT: tl.constexpr, SLEEP_NS: tl.constexpr):
    """Poll the counter until it reaches ``target``; then acquire what was released before."""
    if WAIT == 1:
        while seen < target:
            if SLEEP_NS > 0:
                seen = _nap(seen, SLEEP_NS)
            seen = tl.load(count_ptr, volatile=True)
    elif WAIT == 2:
        while seen < target:
            if SLEEP_NS > 0:
                seen = _nap(seen, SLEEP_NS)
            seen = tl.atomic_add(count_ptr, 0, sem="relaxed")
    if WAIT > 0:
        tl.atomic_add(count_ptr, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _sum_chunks(part_ptr, slot0, num_chunks, t_loc, g, BT: tl.constexpr, CG: tl.constexpr):
    """[BT, 8] sum over the tile's chunks of partial columns ``8g .. 8g+7``: groups of ``CG``
    chunks in order, a tree inside each (the same order in every program, for any T)."""
    cg = tl.arange(0, CG)
    k = tl.arange(0, 8)
    acc = tl.zeros([BT, 8], tl.float32)
    for c0 in range(0, num_chunks, CG):
        chunks = c0 + cg
        offs = ((slot0 + chunks)[:, None, None] * BT + t_loc[None, :, None]) * NPAD + g * 8
        vals = tl.load(
            part_ptr + offs + k[None, None, :], mask=(chunks < num_chunks)[:, None, None],
            other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        acc += tl.sum(vals, axis=0)
    return acc


@triton.jit
def _pick(mat, k, j):
    """Column ``j`` of ``mat`` [BT, 8] as [BT]."""
    return tl.sum(tl.where(k[None, :] == j, mat, 0.0), axis=1)


@triton.jit
def _post_comb(
    mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, sinkhorn_iters,
):  # fmt: skip
    """post and comb (softmax + Sinkhorn) from the rms-scaled mixes ``mix[T, 32]``."""
    j = tl.arange(0, 4)
    m2 = tmask[:, None]
    post = tl.load(mix_ptr + tokens[:, None] * NPAD + POST_COL + j[None, :], mask=m2, other=0.0)
    post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + 4 + j)[None, :])
    tl.store(post_ptr + tokens[:, None] * 4 + j[None, :], post, mask=m2)
    jk = j[:, None] * 4 + j[None, :]
    m3 = tmask[:, None, None]
    logits = tl.load(mix_ptr + tokens[:, None, None] * NPAD + COMB_COL + jk[None, :, :], mask=m3,
                     other=0.0)  # fmt: skip
    logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 8 + jk)[None, :, :]
    peak = tl.max(logits, axis=2)
    comb = tl.exp(logits - peak[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + tokens[:, None, None] * 16 + jk[None, :, :], comb, mask=m3)


@triton.jit
def _partial_projection(x0, x1, x2, x3, fn_ptr, cols, cmask, dim, width, X_BF16: tl.constexpr):
    """[BT, 32] partial mixes of the 4 stream chunks; column SQ_COL: partial sum of squares."""
    outs = tl.arange(0, NPAD)
    acc = tl.zeros([x0.shape[0], NPAD], tl.float32)
    fn_row = tl.where(outs < 4, outs, outs - 4)  # fn rows 0..3 -> 0..3, 4..23 -> 8..27
    used = (outs < 4) | ((outs >= POST_COL) & (outs < COMB_COL + 16))
    wmask = cmask[:, None] & used[None, :]
    w_offs = cols[:, None] + fn_row[None, :] * width
    acc = _split_dot(x0, tl.load(fn_ptr + w_offs, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x1, tl.load(fn_ptr + w_offs + dim, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x2, tl.load(fn_ptr + w_offs + 2 * dim, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x3, tl.load(fn_ptr + w_offs + 3 * dim, mask=wmask, other=0.0), acc, X_BF16)
    f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    sq = tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
    return tl.where(outs[None, :] == SQ_COL, sq[:, None], acc)


@triton.jit
def _finish_pre(part_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr, scale_ptr,
                pre_ptr, dim, norm_eps, hc_eps, BT: tl.constexpr, CG: tl.constexpr):  # fmt: skip
    """Sum the tile's first partial group: returns (its sum [BT, 8], rms [BT]) and stores
    ``pre`` (columns 0..3 of the group, rms-scaled, through the sigmoid head)."""
    k = tl.arange(0, 8)
    g0 = _sum_chunks(part_ptr, slot0, num_chunks, t_loc, 0, BT, CG)
    rms = tl.rsqrt(_pick(g0, k, SQ_COL) / (4 * dim) + norm_eps)
    pre = g0 * rms[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + k, mask=k < 4, other=0.0)
    pre = tl.sigmoid(pre) + hc_eps
    tl.store(pre_ptr + tokens[:, None] * 4 + k[None, :], pre, mask=tmask[:, None] & (k < 4))
    return g0, rms


@triton.jit
def _finish_mix(part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, g0, rms,
                BT: tl.constexpr, CG: tl.constexpr):  # fmt: skip
    """Store the rms-scaled mixes of the tile (``mix[T, 32]``) for :func:`_post_comb`."""
    k = tl.arange(0, 8)
    mp = mix_ptr + tokens[:, None] * NPAD + k[None, :]
    tl.store(mp, g0 * rms[:, None], mask=tmask[:, None])
    for g in tl.static_range(1, 4):
        grp = _sum_chunks(part_ptr, slot0, num_chunks, t_loc, g, BT, CG)
        tl.store(mp + 8 * g, grp * rms[:, None], mask=tmask[:, None])
    tl.debug_barrier()


@triton.jit
def _collapse(x0, x1, x2, x3, p_ptr, tokens, tmask, y_ptr, dim, cols, m2):
    """y[tokens, cols] = sum_j p[t, j] x_j (fp32, j in order)."""
    p = p_ptr + tokens * 4
    y = tl.load(p, mask=tmask, other=0.0, cache_modifier=".cg")[:, None] * x0.to(tl.float32)
    y += tl.load(p + 1, mask=tmask, other=0.0, cache_modifier=".cg")[:, None] * x1.to(tl.float32)
    y += tl.load(p + 2, mask=tmask, other=0.0, cache_modifier=".cg")[:, None] * x2.to(tl.float32)
    y += tl.load(p + 3, mask=tmask, other=0.0, cache_modifier=".cg")[:, None] * x3.to(tl.float32)
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * dim + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m2)  # fmt: skip


@triton.jit
def _hc_pre_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, given_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
    part_ptr, mix_ptr, count_ptr, trace_ptr,
    num_tokens, dim, num_chunks, stride_xt, norm_eps, hc_eps, sinkhorn_iters,
    BT: tl.constexpr, DC: tl.constexpr, CG: tl.constexpr, X_BF16: tl.constexpr,
    GIVEN_PRE: tl.constexpr, WAIT: tl.constexpr, SLEEP_NS: tl.constexpr,
    CSTRIDE: tl.constexpr, ALL_REDUCE: tl.constexpr, REREAD: tl.constexpr,
    TRACE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if TRACE:
        tl.store(trace_ptr + pid * 8, _now(pid))
    tile = pid // num_chunks
    chunk = pid % num_chunks
    t_loc = tl.arange(0, BT)
    tokens = tile * BT + t_loc
    tmask = tokens < num_tokens
    cols = chunk * DC + tl.arange(0, DC)
    cmask = cols < dim
    m2 = tmask[:, None] & cmask[None, :]
    xp = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + cols[None, :]
    x0 = tl.load(xp, mask=m2, other=0.0)
    x1 = tl.load(xp + dim, mask=m2, other=0.0)
    x2 = tl.load(xp + 2 * dim, mask=m2, other=0.0)
    x3 = tl.load(xp + 3 * dim, mask=m2, other=0.0)
    part = _partial_projection(x0, x1, x2, x3, fn_ptr, cols, cmask, dim, 4 * dim, X_BF16)
    slot0 = tile * num_chunks
    outs = tl.arange(0, NPAD)
    tl.store(part_ptr + ((slot0 + chunk) * BT + t_loc)[:, None] * NPAD + outs[None, :], part)
    if GIVEN_PRE:  # V4.1: collapse with the given weights while the others arrive
        _collapse(x0, x1, x2, x3, given_ptr, tokens, tmask, y_ptr, dim, cols, m2)
    counter = count_ptr + tile * CSTRIDE
    tl.debug_barrier()  # every thread's partial stores precede the release
    old = tl.atomic_add(counter, 1, sem="acq_rel")
    if TRACE:
        tl.store(trace_ptr + pid * 8 + 1, _now(pid))
    is_last = old == num_chunks - 1
    if ALL_REDUCE and not GIVEN_PRE:  # the first design: every program adds the partials
        _wait_until(counter, num_chunks, old + 1, WAIT, SLEEP_NS)
        if TRACE:
            tl.store(trace_ptr + pid * 8 + 2, _now(pid))
        g0, rms = _finish_pre(part_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr,
                              scale_ptr, pre_ptr, dim, norm_eps, hc_eps, BT, CG)  # fmt: skip
        tl.debug_barrier()
        _collapse(x0, x1, x2, x3, pre_ptr, tokens, tmask, y_ptr, dim, cols, m2)
        if is_last:
            _finish_mix(part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, g0, rms,
                        BT, CG)  # fmt: skip
            _post_comb(mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps,
                       sinkhorn_iters)  # fmt: skip
    elif is_last:
        g0, rms = _finish_pre(part_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr,
                              scale_ptr, pre_ptr, dim, norm_eps, hc_eps, BT, CG)  # fmt: skip
        tl.debug_barrier()
        if not GIVEN_PRE:
            tl.atomic_add(counter, 1, sem="release")  # pre is published
            _collapse(x0, x1, x2, x3, pre_ptr, tokens, tmask, y_ptr, dim, cols, m2)
        _finish_mix(part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, g0, rms, BT, CG)
        _post_comb(mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps,
                   sinkhorn_iters)  # fmt: skip
    elif not GIVEN_PRE:
        _wait_until(counter, num_chunks + 1, old + 1, WAIT, SLEEP_NS)
        if TRACE:
            tl.store(trace_ptr + pid * 8 + 2, _now(pid))
        if REREAD:  # from L2: the registers are free while waiting
            x0 = tl.load(xp, mask=m2, other=0.0)
            x1 = tl.load(xp + dim, mask=m2, other=0.0)
            x2 = tl.load(xp + 2 * dim, mask=m2, other=0.0)
            x3 = tl.load(xp + 3 * dim, mask=m2, other=0.0)
        _collapse(x0, x1, x2, x3, pre_ptr, tokens, tmask, y_ptr, dim, cols, m2)
    if TRACE:
        tl.store(trace_ptr + pid * 8 + 3, _now(pid))
        tl.store(trace_ptr + pid * 8 + 4, _smid(pid).to(tl.int64))


def _check(x, fn, base, scale, collapse_pre):
    if x.dim() != 3 or x.shape[1] != NC_FUSED:
        raise ValueError(f"x: expected [T, {NC_FUSED}, D], got shape {tuple(x.shape)}")
    t, nc, d = x.shape
    num_out = (2 + nc) * nc
    if fn.shape != (num_out, nc * d):
        raise ValueError(f"fn: expected shape ({num_out}, {nc * d}), got {tuple(fn.shape)}")
    if base.shape != (num_out,) or scale.shape != (3,):
        raise ValueError(f"base/scale: expected ({num_out},)/(3,), got "
                         f"{tuple(base.shape)}/{tuple(scale.shape)}")  # fmt: skip
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x: expected bf16/fp16/fp32, got {x.dtype}")
    if collapse_pre is not None and collapse_pre.shape != (t, nc):
        raise ValueError(f"collapse_pre: expected shape {(t, nc)}, "
                         f"got {tuple(collapse_pre.shape)}")  # fmt: skip


def launch_hc_pre(
    x, fn, base, scale, collapse_pre, kw, tiles: HcPreTiles, sync: HcPreSync, trace=None
):
    """Allocate and launch; returns ``(y, pre, post, comb, compiled kernel)``. ``trace``: an
    int64 ``[programs, 8]`` tensor that receives per-program timestamps (sweeps only)."""
    t, nc, d = x.shape
    dev = x.device
    y = torch.empty(t, d, dtype=x.dtype, device=dev)
    pre = torch.empty(t, nc, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(t, nc, nc, dtype=torch.float32, device=dev)
    if t == 0:
        return y, pre, post, comb, None
    bt = tiles.block_tokens
    one_chunk = dev.type == "cpu" and collapse_pre is None  # the interpreter cannot wait
    dc = triton.next_power_of_2(d) if one_chunk else tiles.block_cols
    num_chunks = triton.cdiv(d, dc)
    num_tiles = triton.cdiv(t, bt)
    part = torch.empty(num_tiles * num_chunks * bt, NPAD.value, dtype=torch.float32, device=dev)
    mix = torch.empty(num_tiles * bt, NPAD.value, dtype=torch.float32, device=dev)
    count = torch.zeros(num_tiles * sync.counter_stride, dtype=torch.int32, device=dev)
    given = pre if collapse_pre is None else collapse_pre.float().contiguous()
    kernel = _hc_pre_kernel[(num_tiles * num_chunks,)](
        x, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(),
        given, y, pre, post, comb, part, mix, count, count if trace is None else trace,
        t, d, num_chunks, x.stride(0), kw["norm_eps"], kw["hc_eps"], kw["sinkhorn_iters"],
        BT=bt, DC=dc, CG=min(8, max(2, triton.next_power_of_2(num_chunks))),
        X_BF16=x.dtype == torch.bfloat16, GIVEN_PRE=collapse_pre is not None,
        WAIT=sync.wait, SLEEP_NS=sync.sleep_ns, CSTRIDE=sync.counter_stride,
        ALL_REDUCE=sync.all_reduce, REREAD=sync.reread, TRACE=trace is not None, num_warps=tiles.num_warps,
    )  # fmt: skip
    return y, pre, post, comb, kernel


@implements("hc_pre")
def hc_pre(
    x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, collapse_pre=None,
    tiles: HcPreTiles | None = None, sync: HcPreSync | None = None,
):  # fmt: skip
    """See :func:`deepinfer.kernels.hc_pre`; ``tiles`` / ``sync`` override the launch
    (benchmark sweeps)."""
    _check(x, fn, base, scale, collapse_pre)
    x = x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
    kw = {"norm_eps": norm_eps, "hc_eps": hc_eps, "sinkhorn_iters": sinkhorn_iters}
    y, pre, post, comb, _ = launch_hc_pre(
        x, fn, base, scale, collapse_pre, kw, tiles or DEFAULT_TILES, sync or DEFAULT_SYNC
    )
    return y, pre, post, comb
