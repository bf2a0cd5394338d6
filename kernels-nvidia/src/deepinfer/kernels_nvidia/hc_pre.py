"""mHC pre stage in ONE pass over the streams: coefficients (RMS, projection, sigmoid heads,
Sinkhorn) fused with the collapse ``y = sum_j pre[j] h[j]``, for 4 streams.

Why a barrier: ``pre`` needs the projection of a token's whole ``4 x D`` row, and the collapse
needs ``pre``; a plain two-kernel split reads the streams twice (9 units of ``T x D`` traffic
instead of 5). Here a program owns ``BT`` tokens x ``DC`` columns of each stream, keeps them in
registers, writes its partial projection (fp32, 3-term bf16 split on the tensor cores as in
:mod:`.hc`) and the partial sum of squares, then waits on a per-tile arrival counter until
every chunk of its tile has arrived. All programs of a tile then reduce the same partials in
the same order (so they agree bit for bit on ``pre``) and collapse the columns they hold. The
last program to arrive also finishes ``post`` and ``comb`` for the tile.

Progress: a program waits only for the other chunks of its own tile, whose program ids are
adjacent (chunk is the fastest grid index); blocks are dispatched in id order, so the lowest
unfinished tile always has all its programs resident once ``num_chunks`` fits in one wave.
Under the Triton interpreter (CPU tensors) programs run one after another, so a tile is one
program there (``DC`` covers ``D``).

Chunking depends only on ``D`` (never on ``T``), so results are batch invariant.

Status (H200, 2026-11-30, this exact code): exact against the two ops (max difference 0 at
T 16,384, D 4096) but SLOW: 76 ms there (the two ops: 1.0 ms), as if the tiles' programs ran
one after another; the cause is not found yet (polling the counter with volatile loads instead
of atomics did not change it: 77 ms at 8987457). Not an op and not used by the engine; kept so
the measurement can be repeated (``benchmarks/kernels/bench_hc.py`` times it as "pre fused").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.hc import _split_dot

NC_FUSED = 4  # streams the fused kernel handles (V4 / V4.1 hc_mult)
NPAD = 32  # projection outputs padded: 24 used, column SQ_COL carries the sum of squares
SQ_COL = 24


@dataclass(frozen=True)
class HcPreTiles:
    """Tokens per tile, stream columns per program, warps."""

    block_tokens: int = 16
    block_cols: int = 128
    num_warps: int = 4


DEFAULT_TILES = HcPreTiles()


@triton.jit
def _load_group(part_ptr, slot0, chunks, cmask, t_loc, g, BT: tl.constexpr):
    """[BT, 8] sum over the tile's chunks of partial columns ``8g .. 8g+7`` (one tree sum,
    the same in every program)."""
    k = tl.arange(0, 8)
    offs = ((slot0 + chunks)[:, None, None] * BT + t_loc[None, :, None]) * 32 + g * 8
    vals = tl.load(
        part_ptr + offs + k[None, None, :], mask=cmask[:, None, None], other=0.0,
        cache_modifier=".cg",
    )  # fmt: skip
    return tl.sum(vals, axis=0)


@triton.jit
def _pick(mat, k, j):
    """Column ``j`` of ``mat`` [BT, 8] as [BT]."""
    return tl.sum(tl.where(k[None, :] == j, mat, 0.0), axis=1)


@triton.jit
def _post_comb(
    mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps, sinkhorn_iters,
    NC: tl.constexpr,
):  # fmt: skip
    """post and comb (softmax + Sinkhorn) from the rms-scaled mixes ``mix[T, 32]``."""
    j = tl.arange(0, NC)
    m2 = tmask[:, None]
    post = tl.load(mix_ptr + tokens[:, None] * 32 + NC + j[None, :], mask=m2, other=0.0)
    post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + NC + j)[None, :])
    tl.store(post_ptr + tokens[:, None] * NC + j[None, :], post, mask=m2)
    jk = j[:, None] * NC + j[None, :]
    m3 = tmask[:, None, None]
    logits = tl.load(mix_ptr + tokens[:, None, None] * 32 + 2 * NC + jk[None, :, :], mask=m3,
                     other=0.0)  # fmt: skip
    logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * NC + jk)[None, :, :]
    peak = tl.max(logits, axis=2)
    comb = tl.exp(logits - peak[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + tokens[:, None, None] * (NC * NC) + jk[None, :, :], comb, mask=m3)


@triton.jit
def _partial_projection(x0, x1, x2, x3, fn_ptr, cols, cmask, dim, width, X_BF16: tl.constexpr):
    """[BT, 32] partial mixes of the 4 stream chunks; column SQ_COL: partial sum of squares."""
    outs = tl.arange(0, 32)
    omask = outs < 24
    acc = tl.zeros([x0.shape[0], 32], tl.float32)
    wmask = cmask[:, None] & omask[None, :]
    w_offs = cols[:, None] + outs[None, :] * width
    acc = _split_dot(x0, tl.load(fn_ptr + w_offs, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x1, tl.load(fn_ptr + w_offs + dim, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x2, tl.load(fn_ptr + w_offs + 2 * dim, mask=wmask, other=0.0), acc, X_BF16)
    acc = _split_dot(x3, tl.load(fn_ptr + w_offs + 3 * dim, mask=wmask, other=0.0), acc, X_BF16)
    f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    sq = tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
    return tl.where(outs[None, :] == 24, sq[:, None], acc)


@triton.jit
def _wait_for_tile(count_ptr, tile, num_chunks):
    """Arrive at the tile's counter, spin until every chunk has; returns True for the last."""
    tl.debug_barrier()  # every thread's partial stores precede the release
    old = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    seen = old + 1
    while seen < num_chunks:  # poll with plain volatile loads: atomics on one address serialise
        seen = tl.load(count_ptr + tile, volatile=True)
    tl.atomic_add(count_ptr + tile, 0, sem="acquire")  # then acquire the other chunks' partials
    tl.debug_barrier()
    return old == num_chunks - 1


@triton.jit
def _hc_pre_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
    part_ptr, mix_ptr, count_ptr,
    num_tokens, dim, num_chunks, stride_xt, norm_eps, hc_eps, sinkhorn_iters,
    BT: tl.constexpr, DC: tl.constexpr, CP: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
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
    outs = tl.arange(0, 32)
    tl.store(part_ptr + ((slot0 + chunk) * BT + t_loc)[:, None] * 32 + outs[None, :], part)
    is_last = _wait_for_tile(count_ptr, tile, num_chunks)

    chunks = tl.arange(0, CP)
    ccmask = chunks < num_chunks
    k = tl.arange(0, 8)
    g0 = _load_group(part_ptr, slot0, chunks, ccmask, t_loc, 0, BT)
    g3 = _load_group(part_ptr, slot0, chunks, ccmask, t_loc, 3, BT)
    rms = tl.rsqrt(_pick(g3, k, 0) / (4 * dim) + norm_eps)
    pre = g0 * rms[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + k, mask=k < 4, other=0.0)
    pre = tl.sigmoid(pre) + hc_eps  # columns 0..3 used
    y = _pick(pre, k, 0)[:, None] * x0.to(tl.float32)
    y += _pick(pre, k, 1)[:, None] * x1.to(tl.float32)
    y += _pick(pre, k, 2)[:, None] * x2.to(tl.float32)
    y += _pick(pre, k, 3)[:, None] * x3.to(tl.float32)
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * dim + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m2)  # fmt: skip
    if chunk == 0:
        tl.store(pre_ptr + tokens[:, None] * 4 + k[None, :], pre, mask=tmask[:, None] & (k < 4))
    if is_last:
        mp = mix_ptr + tokens[:, None] * 32 + k[None, :]
        tl.store(mp, g0 * rms[:, None], mask=tmask[:, None])
        g1 = _load_group(part_ptr, slot0, chunks, ccmask, t_loc, 1, BT)
        tl.store(mp + 8, g1 * rms[:, None], mask=tmask[:, None])
        g2 = _load_group(part_ptr, slot0, chunks, ccmask, t_loc, 2, BT)
        tl.store(mp + 16, g2 * rms[:, None], mask=tmask[:, None])
        tl.debug_barrier()
        _post_comb(mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps,
                   sinkhorn_iters, NC=4)  # fmt: skip


def _check(x, fn, base, scale):
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


def hc_pre(
    x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, tiles: HcPreTiles | None = None
):
    """``hc_mix_coefficients`` then ``hc_collapse`` in one launch over the streams.

    x ``[T, 4, D]`` (bf16 / fp16 / fp32), fn ``[24, 4 D]``, base ``[24]``, scale ``[3]`` fp32.
    Returns ``(y [T, D] x.dtype, pre [T, 4], post [T, 4], comb [T, 4, 4])`` (fp32 weights),
    equal to the two ops' results (same fp32 math; chunk sums in a fixed order).
    """
    _check(x, fn, base, scale)
    x = x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
    t, nc, d = x.shape
    dev = x.device
    y = torch.empty(t, d, dtype=x.dtype, device=dev)
    pre = torch.empty(t, nc, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(t, nc, nc, dtype=torch.float32, device=dev)
    if t == 0:
        return y, pre, post, comb
    tiles = tiles or DEFAULT_TILES
    bt = tiles.block_tokens
    # The interpreter runs programs in turn: one program per tile there (no waiting).
    dc = triton.next_power_of_2(d) if dev.type == "cpu" else tiles.block_cols
    num_chunks = triton.cdiv(d, dc)
    num_tiles = triton.cdiv(t, bt)
    part = torch.empty(num_tiles * num_chunks * bt, NPAD, dtype=torch.float32, device=dev)
    mix = torch.empty(num_tiles * bt, NPAD, dtype=torch.float32, device=dev)
    count = torch.zeros(num_tiles, dtype=torch.int32, device=dev)
    _hc_pre_kernel[(num_tiles * num_chunks,)](
        x, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(),
        y, pre, post, comb, part, mix, count,
        t, d, num_chunks, x.stride(0), norm_eps, hc_eps, sinkhorn_iters,
        BT=bt, DC=dc, CP=max(2, triton.next_power_of_2(num_chunks)),
        X_BF16=x.dtype == torch.bfloat16, num_warps=tiles.num_warps,
    )  # fmt: skip
    return y, pre, post, comb
