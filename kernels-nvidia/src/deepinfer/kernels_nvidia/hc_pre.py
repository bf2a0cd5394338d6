"""mHC pre site (``hc_pre``) for 4 streams: the coefficients (RMS, projection, sigmoid heads,
Sinkhorn) and the collapse ``y = sum_j p[j] h[j]``, streaming the streams once.

One launch computes the coefficients: a program owns ``BT`` tokens x a fixed chunk of ``DC``
columns of each of the 4 streams and walks it in ``BK``-column steps (software-pipelined loads),
accumulating the partial projection (fp32 weights as three bf16 terms on the tensor cores, as in
:mod:`.hc`) and the partial sum of squares. It stores its ``[BT, 32]`` partial and arrives at
its tile's counter; the LAST program to arrive adds the tile's partials (one fixed-order sum over
chunks) and finishes ``pre``, ``post`` and ``comb``. Nobody waits.

- ``collapse_pre`` given (V4.1's deferred pre-mix: the previous site's weights collapse these
  streams): each step also collapses the columns it just loaded, so the streams are read ONCE.
- V4 (``p = pre`` of the same streams): a collapse needs every column's projection first. The
  collapse then runs as a second pass (:func:`.hc.hc_collapse`), which reads the streams from L2
  when ``T x 4 x D`` fits there (decode batches) and from HBM at prefill sizes.

The streaming launch measured no faster than ``hc_mix_coefficients`` + ``hc_collapse``: it is
bound by the per-step work around the projection (three bf16 products per stream, the fp32
conversions for the sum of squares and the collapse; on sm_90 the shape needs all 255 registers,
so 2 programs per multiprocessor), not by memory (inferred, not profiled).

Why no single V4 pass: a grid-wide variant (programs keep their columns in registers, wait for
the tile's other chunks, then collapse) stayed latency-bound even with the wait removed: each
program holds a few KB of streams for the microseconds its load, projection and arrival take,
and holding a 3 TB/s stream across such a wait needs tens of MB on chip. A persistent,
software-pipelined grid was slower still. The numbers are in ``benchmarks/RESULTS.md`` (mHC).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.hc import _split_dot, hc_collapse, sinkhorn_comb
from deepinfer.kernels_nvidia.registry import implements

NC_FUSED = 4  # streams the fused kernel handles (V4 / V4.1 hc_mult)
# Partial columns: 0..3 pre mixes, 4 the sum of squares, 8..11 post, 12..27 comb; rest zero.
NPAD = tl.constexpr(32)
SQ_COL = tl.constexpr(4)
POST_COL = tl.constexpr(8)
COMB_COL = tl.constexpr(12)


@dataclass(frozen=True)
class HcPreTiles:
    """Launch shape: tokens per program, stream columns per program (the chunk: fixed per D,
    never per T), warps, columns per step, pipeline stages, and the program order (a tile's
    chunks adjacent, or a chunk's tiles)."""

    block_tokens: int = 64
    block_cols: int = 512
    num_warps: int = 4
    block_k: int = 32
    num_stages: int = 3
    chunk_major: bool = False


DEFAULT_TILES = HcPreTiles()


@triton.jit
def _sum_chunks(part_ptr, slot0, num_chunks, t_loc, g, BT: tl.constexpr, CG: tl.constexpr):
    """[BT, 8] sum over the tile's chunks of partial columns ``8g .. 8g+7``: groups of ``CG``
    chunks in order, a tree inside each (the same order for any T)."""
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
    logits = tl.load(mix_ptr + tokens[:, None, None] * NPAD + COMB_COL + jk[None, :, :],
                     mask=m3, other=0.0)  # fmt: skip
    logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 8 + jk)[None, :, :]
    comb = sinkhorn_comb(logits, hc_eps, sinkhorn_iters)
    tl.store(comb_ptr + tokens[:, None, None] * 16 + jk[None, :, :], comb, mask=m3)


@triton.jit
def _finish_tile(
    part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr, scale_ptr,
    pre_ptr, post_ptr, comb_ptr, dim, norm_eps, hc_eps, sinkhorn_iters,
    BT: tl.constexpr, CG: tl.constexpr,
):  # fmt: skip
    """Sum the tile's partials; store ``pre``, ``post``, ``comb`` of its tokens."""
    k = tl.arange(0, 8)
    g0 = _sum_chunks(part_ptr, slot0, num_chunks, t_loc, 0, BT, CG)
    rms = tl.rsqrt(_pick(g0, k, SQ_COL) / (4 * dim) + norm_eps)
    pre = g0 * rms[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + k, mask=k < 4, other=0.0)
    pre = tl.sigmoid(pre) + hc_eps
    tl.store(pre_ptr + tokens[:, None] * 4 + k[None, :], pre, mask=tmask[:, None] & (k < 4))
    mp = mix_ptr + tokens[:, None] * NPAD + k[None, :]
    for g in tl.static_range(1, 4):
        grp = _sum_chunks(part_ptr, slot0, num_chunks, t_loc, g, BT, CG)
        tl.store(mp + 8 * g, grp * rms[:, None], mask=tmask[:, None])
    tl.debug_barrier()  # the mixes are read back in another layout
    _post_comb(mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps,
               sinkhorn_iters)  # fmt: skip


@triton.jit
def _stream_weights(fn_ptr, cols, cmask, width):
    """[BK, 32] weight offsets and mask of stream 0 (fn rows placed at the partial columns)."""
    outs = tl.arange(0, NPAD)
    fn_row = tl.where(outs < 4, outs, outs - 4)  # fn rows 0..3 -> 0..3, 4..23 -> 8..27
    used = (outs < 4) | ((outs >= POST_COL) & (outs < COMB_COL + 16))
    return fn_ptr + cols[:, None] + fn_row[None, :] * width, cmask[:, None] & used[None, :]


@triton.jit
def _hc_pre_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, given_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
    part_ptr, mix_ptr, count_ptr,
    num_tokens, dim, num_tiles, num_chunks, stride_xt, stride_xs, norm_eps, hc_eps,
    sinkhorn_iters, BT: tl.constexpr, DC: tl.constexpr, BK: tl.constexpr, CG: tl.constexpr,
    X_BF16: tl.constexpr, COLLAPSE: tl.constexpr, CHUNK_MAJOR: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if CHUNK_MAJOR:  # a tile's chunks run side by side
        tile = pid // num_chunks
        chunk = pid % num_chunks
    else:  # a chunk's tiles run side by side (they share its weights)
        tile = pid % num_tiles
        chunk = pid // num_tiles
    t_loc = tl.arange(0, BT)
    tokens = tile * BT + t_loc
    tmask = tokens < num_tokens
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    y_rows = y_ptr + tokens.to(tl.int64)[:, None] * dim
    if COLLAPSE:  # the given weights, fp32 [T, 4]
        p0 = tl.load(given_ptr + tokens * 4, mask=tmask, other=0.0)[:, None]
        p1 = tl.load(given_ptr + tokens * 4 + 1, mask=tmask, other=0.0)[:, None]
        p2 = tl.load(given_ptr + tokens * 4 + 2, mask=tmask, other=0.0)[:, None]
        p3 = tl.load(given_ptr + tokens * 4 + 3, mask=tmask, other=0.0)[:, None]
    acc = tl.zeros([BT, NPAD], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    for k0 in range(chunk * DC, chunk * DC + DC, BK):
        cols = k0 + tl.arange(0, BK)
        cmask = cols < dim
        m2 = tmask[:, None] & cmask[None, :]
        xp = x_rows + cols[None, :]
        x0 = tl.load(xp, mask=m2, other=0.0)
        x1 = tl.load(xp + stride_xs, mask=m2, other=0.0)
        x2 = tl.load(xp + 2 * stride_xs, mask=m2, other=0.0)
        x3 = tl.load(xp + 3 * stride_xs, mask=m2, other=0.0)
        wp, wmask = _stream_weights(fn_ptr, cols, cmask, 4 * dim)
        acc = _split_dot(x0, tl.load(wp, mask=wmask, other=0.0), acc, X_BF16)
        acc = _split_dot(x1, tl.load(wp + dim, mask=wmask, other=0.0), acc, X_BF16)
        acc = _split_dot(x2, tl.load(wp + 2 * dim, mask=wmask, other=0.0), acc, X_BF16)
        acc = _split_dot(x3, tl.load(wp + 3 * dim, mask=wmask, other=0.0), acc, X_BF16)
        f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        sq += tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
        if COLLAPSE:  # fp32, streams in order
            y = p0 * f0
            y += p1 * f1
            y += p2 * f2
            y += p3 * f3
            tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)
    outs = tl.arange(0, NPAD)
    part = tl.where(outs[None, :] == SQ_COL, sq[:, None], acc)
    slot0 = tile * num_chunks
    tl.store(part_ptr + ((slot0 + chunk) * BT + t_loc)[:, None] * NPAD + outs[None, :], part)
    tl.debug_barrier()  # every thread's partial stores precede the release
    if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == num_chunks - 1:
        _finish_tile(part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr,
                     scale_ptr, pre_ptr, post_ptr, comb_ptr, dim, norm_eps, hc_eps,
                     sinkhorn_iters, BT, CG)  # fmt: skip


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


def _chunk_cols(dim: int, tiles: HcPreTiles) -> int:
    """Columns per program: the tile's chunk, at most D rounded up to a step (depends on D
    only)."""
    bk = tiles.block_k
    if tiles.block_cols % bk:
        raise ValueError(f"tiles: block_cols {tiles.block_cols} is not a multiple of {bk}")
    return min(tiles.block_cols, triton.cdiv(dim, bk) * bk)


def hc_mix_and_collapse(x, fn, base, scale, collapse_pre, kw, tiles: HcPreTiles):
    """One streaming launch: ``(y or None, pre, post, comb)``; ``y`` only when ``collapse_pre``
    is given. x ``[T, 4, D]`` with unit column stride."""
    t, nc, d = x.shape
    dev = x.device
    pre = torch.empty(t, nc, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(t, nc, nc, dtype=torch.float32, device=dev)
    collapse = collapse_pre is not None
    y = torch.empty(t, d, dtype=x.dtype, device=dev) if collapse else None
    if t == 0:
        return y, pre, post, comb
    bt = tiles.block_tokens
    dc = _chunk_cols(d, tiles)
    num_chunks, num_tiles = triton.cdiv(d, dc), triton.cdiv(t, bt)
    part = torch.empty(num_tiles * num_chunks * bt, NPAD.value, dtype=torch.float32, device=dev)
    mix = torch.empty(num_tiles * bt, NPAD.value, dtype=torch.float32, device=dev)
    count = torch.zeros(num_tiles, dtype=torch.int32, device=dev)
    given = collapse_pre.float().contiguous() if collapse else pre
    _hc_pre_kernel[(num_tiles * num_chunks,)](
        x, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(),
        given, pre if y is None else y, pre, post, comb, part, mix, count,
        t, d, num_tiles, num_chunks, x.stride(0), x.stride(1), kw["norm_eps"], kw["hc_eps"],
        kw["sinkhorn_iters"],
        BT=bt, DC=dc, BK=tiles.block_k, CG=min(16, max(2, triton.next_power_of_2(num_chunks))),
        X_BF16=x.dtype == torch.bfloat16, COLLAPSE=collapse, CHUNK_MAJOR=tiles.chunk_major,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y, pre, post, comb


@implements("hc_pre")
def hc_pre(
    x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, collapse_pre=None,
    tiles: HcPreTiles | None = None,
):  # fmt: skip
    """See :func:`deepinfer.kernels.hc_pre`; ``tiles`` overrides the launch (benchmark sweeps).

    With ``collapse_pre`` (V4.1) one launch reads the streams once; without (V4) the collapse
    with this site's ``pre`` follows as a second launch (:func:`.hc.hc_collapse`)."""
    _check(x, fn, base, scale, collapse_pre)
    x = x if x.stride(2) == 1 else x.contiguous()
    kw = {"norm_eps": norm_eps, "hc_eps": hc_eps, "sinkhorn_iters": sinkhorn_iters}
    y, pre, post, comb = hc_mix_and_collapse(
        x, fn, base, scale, collapse_pre, kw, tiles or DEFAULT_TILES
    )
    if y is None:
        y = hc_collapse(x, pre)
    return y, pre, post, comb
