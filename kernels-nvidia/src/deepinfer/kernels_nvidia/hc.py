"""Manifold-constrained hyper-connections (mHC) in Triton: mixing coefficients with Sinkhorn,
the stream collapse and the post-mix expand (fp32 inside, streams' dtype out).

Coefficients take two launches. The first reads the flattened streams once: each program
multiplies a block of ``BT`` tokens by a fixed-width column chunk (``K_CHUNK``) of the small
projection and sums the squares for the RMS, writing per-chunk partials. The projection keeps
fp32 accuracy: bf16 streams meet the fp32 weights split into three bf16 terms on the tensor
cores (each product exact in the fp32 accumulator); other dtypes take an exact fp32 dot. The
second launch adds a token's chunks in one reduction, applies the RMS scale, the sigmoid heads
and the softmax + Sinkhorn rounds of the ``nc x nc`` comb matrix. Chunk width and reduction
shape never depend on the number of tokens, so results are batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements

K_CHUNK = 1024  # projection columns per partial: fixed, for batch invariance
# tokens per projection program (the dot's M): 64 took well under half the time of 16 on the
# H200 (bench_hc.py)
TOKENS_PER_PROGRAM = 64
FINISH_TOKENS = 8  # tokens per coefficient program


@triton.jit
def _split_dot(x, w, acc, X_BF16: tl.constexpr):
    """acc + x @ w with fp32 accuracy. bf16 x: w (fp32) is split into three bf16 terms whose
    products with x are exact in the fp32 accumulator (tensor cores, no tf32 loss); else an
    exact fp32 dot."""
    if X_BF16:
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(x, lo, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, hi, acc)
    else:
        acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    return acc


@triton.jit
def _hc_mix_partial_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr,
    num_tokens, num_out, width, num_chunks, stride_xt, stride_fn,
    BT: tl.constexpr, NPAD: tl.constexpr, BK: tl.constexpr, K_CHUNK: tl.constexpr,
    X_BF16: tl.constexpr,
):  # fmt: skip
    """part[t, c, :] = x[t, chunk c] @ fn[:, chunk c]^T; sq[t, c] = sum x[t, chunk c]^2."""
    pid_t = tl.program_id(0)
    chunk = tl.program_id(1)
    tokens = pid_t * BT + tl.arange(0, BT)
    tmask = tokens < num_tokens
    outs = tl.arange(0, NPAD)
    omask = outs < num_out
    acc = tl.zeros([BT, NPAD], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    for k0 in range(chunk * K_CHUNK, chunk * K_CHUNK + K_CHUNK, BK):
        cols = k0 + tl.arange(0, BK)
        cmask = cols < width
        x = tl.load(
            x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + cols[None, :],
            mask=tmask[:, None] & cmask[None, :],
            other=0.0,
        )
        w = tl.load(
            fn_ptr + cols[:, None] + outs[None, :] * stride_fn,
            mask=cmask[:, None] & omask[None, :],
            other=0.0,
        )
        acc = _split_dot(x, w, acc, X_BF16)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    slot = tokens * num_chunks + chunk
    tl.store(part_ptr + slot[:, None] * NPAD + outs[None, :], acc, mask=tmask[:, None])
    tl.store(sq_ptr + slot, sq, mask=tmask)


@triton.jit
def _chunk_rows(tokens, tmask, num_chunks, CP: tl.constexpr):
    """([BT, CP] partial row of each (token, chunk), its mask)."""
    chunks = tl.arange(0, CP)
    rows = tokens[:, None] * num_chunks + chunks[None, :]
    return rows, tmask[:, None] & (chunks < num_chunks)[None, :]


@triton.jit
def _rms_scale(sq_ptr, rows, mask, width, eps):
    """rsqrt(mean square + eps) per token: the chunk sums added in one reduction."""
    sq = tl.sum(tl.load(sq_ptr + rows, mask=mask, other=0.0), axis=1)
    return tl.rsqrt(sq / width + eps)


@triton.jit
def _sum_mix(part_ptr, rows, mask, first, j, NPAD: tl.constexpr):
    """[BT, NC] sum over chunks of part[token, chunk, first + j]."""
    offs = rows[:, :, None] * NPAD + first + j[None, None, :]
    return tl.sum(tl.load(part_ptr + offs, mask=mask[:, :, None], other=0.0), axis=1)


@triton.jit
def sinkhorn_comb(logits, hc_eps, sinkhorn_iters):
    """``[BT, nc, nc]`` comb from its logits: a row softmax (+ eps), then Sinkhorn rounds that
    normalise columns and rows in turn (``sinkhorn_iters`` column passes in all)."""
    peak = tl.max(logits, axis=2)
    comb = tl.exp(logits - peak[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    return comb


@triton.jit
def _hc_mix_finish_kernel(
    part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    num_tokens, num_chunks, width, norm_eps, hc_eps, sinkhorn_iters,
    BT: tl.constexpr, NC: tl.constexpr, NPAD: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = tokens < num_tokens
    rows, rmask = _chunk_rows(tokens, tmask, num_chunks, CP)
    rms = _rms_scale(sq_ptr, rows, rmask, width, norm_eps)
    j = tl.arange(0, NC)
    m2 = tmask[:, None]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = _sum_mix(part_ptr, rows, rmask, 0, j, NPAD) * rms[:, None]
    pre = tl.sigmoid(pre * s0 + tl.load(base_ptr + j)[None, :]) + hc_eps
    post = _sum_mix(part_ptr, rows, rmask, NC, j, NPAD) * rms[:, None]
    post = 2.0 * tl.sigmoid(post * s1 + tl.load(base_ptr + NC + j)[None, :])
    out2 = tokens[:, None] * NC + j[None, :]
    tl.store(pre_ptr + out2, pre, mask=m2)
    tl.store(post_ptr + out2, post, mask=m2)

    jk = j[:, None] * NC + j[None, :]  # [NC, NC] flat (j, k)
    offs4 = rows[:, :, None, None] * NPAD + 2 * NC + jk[None, None, :, :]
    comb_part = tl.load(part_ptr + offs4, mask=rmask[:, :, None, None], other=0.0)
    logits = tl.sum(comb_part, axis=1) * rms[:, None, None]
    m3 = tmask[:, None, None]
    logits = logits * s2 + tl.load(base_ptr + 2 * NC + jk)[None, :, :]
    comb = sinkhorn_comb(logits, hc_eps, sinkhorn_iters)
    tl.store(comb_ptr + tokens[:, None, None] * (NC * NC) + jk[None, :, :], comb, mask=m3)


@triton.jit
def _hc_head_finish_kernel(
    part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr,
    num_tokens, num_chunks, width, norm_eps, hc_eps,
    BT: tl.constexpr, NC: tl.constexpr, NPAD: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = tokens < num_tokens
    rows, rmask = _chunk_rows(tokens, tmask, num_chunks, CP)
    rms = _rms_scale(sq_ptr, rows, rmask, width, norm_eps)
    j = tl.arange(0, NC)
    m = _sum_mix(part_ptr, rows, rmask, 0, j, NPAD) * rms[:, None]
    pre = tl.sigmoid(m * tl.load(scale_ptr) + tl.load(base_ptr + j)[None, :]) + hc_eps
    tl.store(pre_ptr + tokens[:, None] * NC + j[None, :], pre, mask=tmask[:, None])


def _streams_2d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name}: expected [T, nc, D], got shape {tuple(x.shape)}")
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def _mix_partials(x, fn, num_out, tokens_per_program=None):
    """Launch the chunked projection: returns (partials, sums of squares, number of chunks)."""
    t, nc, d = x.shape
    width = nc * d
    if fn.shape != (num_out, width):
        raise ValueError(f"fn: expected shape ({num_out}, {width}), got {tuple(fn.shape)}")
    fn = fn.float().contiguous()
    npad = max(16, triton.next_power_of_2(num_out))
    num_chunks = triton.cdiv(width, K_CHUNK)
    part = torch.empty(t, num_chunks, npad, dtype=torch.float32, device=x.device)
    sq = torch.empty(t, num_chunks, dtype=torch.float32, device=x.device)
    bt = tokens_per_program or TOKENS_PER_PROGRAM
    grid = (triton.cdiv(t, bt), num_chunks)
    _hc_mix_partial_kernel[grid](
        x, fn, part, sq, t, num_out, width, num_chunks, x.stride(0), fn.stride(0),
        BT=bt, NPAD=npad, BK=64, K_CHUNK=K_CHUNK,
        X_BF16=x.dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return part, sq, num_chunks, npad


@implements("hc_mix_coefficients")
def hc_mix_coefficients(
    x, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, tokens_per_program=None
):
    """See :func:`deepinfer.kernels.hc_mix_coefficients`; ``tokens_per_program`` overrides the
    projection's M (benchmark sweeps; a token's sums never depend on it)."""
    x = _streams_2d(x, "x")
    t, nc, d = x.shape
    if nc & (nc - 1):
        raise ValueError(f"x: the number of streams must be a power of two, got {nc}")
    num_out = (2 + nc) * nc
    if base.shape != (num_out,) or scale.shape != (3,):
        raise ValueError(f"base/scale: expected ({num_out},)/(3,), got "
                         f"{tuple(base.shape)}/{tuple(scale.shape)}")  # fmt: skip
    pre = torch.empty(t, nc, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, nc, nc, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre, post, comb
    part, sq, num_chunks, npad = _mix_partials(x, fn, num_out, tokens_per_program)
    _hc_mix_finish_kernel[(triton.cdiv(t, FINISH_TOKENS),)](
        part, sq, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
        t, num_chunks, nc * d, norm_eps, hc_eps, sinkhorn_iters,
        BT=FINISH_TOKENS, NC=nc, NPAD=npad, CP=triton.next_power_of_2(num_chunks), num_warps=4,
    )  # fmt: skip
    return pre, post, comb


@implements("hc_head_coefficients")
def hc_head_coefficients(x, fn, base, scale, *, norm_eps, hc_eps):
    x = _streams_2d(x, "x")
    t, nc, d = x.shape
    if nc & (nc - 1):
        raise ValueError(f"x: the number of streams must be a power of two, got {nc}")
    if base.shape != (nc,) or scale.numel() < 1:
        raise ValueError(f"base: expected ({nc},), got {tuple(base.shape)}")
    pre = torch.empty(t, nc, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre
    part, sq, num_chunks, npad = _mix_partials(x, fn, nc)
    _hc_head_finish_kernel[(triton.cdiv(t, FINISH_TOKENS),)](
        part, sq, base.float().contiguous(), scale.float().contiguous(), pre,
        t, num_chunks, nc * d, norm_eps, hc_eps,
        BT=FINISH_TOKENS, NC=nc, NPAD=npad, CP=triton.next_power_of_2(num_chunks), num_warps=4,
    )  # fmt: skip
    return pre


@triton.jit
def _hc_collapse_kernel(
    h_ptr, pre_ptr, out_ptr, dim, stride_ht, stride_hj, stride_ot,
    NC: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """out[t, d-block] = sum_j pre[t, j] h[t, j, d-block] (fp32, j in order)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    j = tl.arange(0, NC)
    h = tl.load(h_ptr + t * stride_ht + j[:, None] * stride_hj + cols[None, :],
                mask=cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    pre = tl.load(pre_ptr + t * NC + j)
    y = tl.sum(pre[:, None] * h, axis=0)
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _hc_expand_kernel(
    f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, dim, stride_ft, stride_ht, stride_hj,
    NC: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """out[t, k, d] = post[t, k] f[t, d] + sum_j comb[t, j, k] h[t, j, d] (fp32), any NC."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    j = tl.arange(0, NC)
    h = tl.load(h_ptr + t * stride_ht + j[:, None] * stride_hj + cols[None, :],
                mask=cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
    f = tl.load(f_ptr + t * stride_ft + cols, mask=cmask, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + t * NC * NC + j[:, None] * NC + j[None, :])  # [j, k]
    post = tl.load(post_ptr + t * NC + j)
    mixed = tl.sum(comb[:, :, None] * h[:, None, :], axis=0)  # [k, BD]
    out = post[:, None] * f[None, :] + mixed
    out_offs = t * NC * dim + j[:, None] * dim + cols[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=cmask[None, :])


@triton.jit
def _expand_row(out_ptr, k, t, dim, cols, cmask, f, h0, h1, h2, h3, post_ptr, comb_ptr):
    c = comb_ptr + t * 16 + k
    out = tl.load(post_ptr + t * 4 + k) * f + tl.load(c) * h0 + tl.load(c + 4) * h1
    out += tl.load(c + 8) * h2 + tl.load(c + 12) * h3
    tl.store(out_ptr + (t * 4 + k) * dim + cols, out.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _hc_expand4_kernel(
    f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, dim, stride_ft, stride_ht, stride_hj,
    BD: tl.constexpr,
):  # fmt: skip
    """The 4-stream expand with one ``[BD]`` register row per stream (no ``[4, 4, BD]``
    intermediate): same sums, j in order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    f = tl.load(f_ptr + t * stride_ft + cols, mask=cmask, other=0.0).to(tl.float32)
    h_row = h_ptr + t * stride_ht + cols
    h0 = tl.load(h_row, mask=cmask, other=0.0).to(tl.float32)
    h1 = tl.load(h_row + stride_hj, mask=cmask, other=0.0).to(tl.float32)
    h2 = tl.load(h_row + 2 * stride_hj, mask=cmask, other=0.0).to(tl.float32)
    h3 = tl.load(h_row + 3 * stride_hj, mask=cmask, other=0.0).to(tl.float32)
    for k in tl.static_range(4):
        _expand_row(out_ptr, k, t, dim, cols, cmask, f, h0, h1, h2, h3, post_ptr, comb_ptr)


def _check_coeffs(name, t, shape_tail, coeff):
    if coeff.shape != (t, *shape_tail):
        raise ValueError(f"{name}: expected shape {(t, *shape_tail)}, got {tuple(coeff.shape)}")
    return coeff.float().contiguous()


def _block_d(dim: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(dim)))


@implements("hc_collapse")
def hc_collapse(h, pre):
    if h.dim() != 3:
        raise ValueError(f"h: expected [T, nc, D], got shape {tuple(h.shape)}")
    h = h if h.stride(2) == 1 else h.contiguous()
    t, nc, d = h.shape
    pre = _check_coeffs("pre", t, (nc,), pre)
    out = torch.empty(t, d, dtype=h.dtype, device=h.device)
    if t == 0:
        return out
    bd = _block_d(d)
    _hc_collapse_kernel[(t, triton.cdiv(d, bd))](
        h, pre, out, d, h.stride(0), h.stride(1), out.stride(0), NC=nc, BD=bd, num_warps=4
    )
    return out


EXPAND_BLOCK_D = 1024  # columns per expand program (x 4 streams)
EXPAND_WARPS = 4


@implements("hc_expand")
def hc_expand(f, h, post, comb, *, block_d: int | None = None, num_warps: int | None = None):
    """See :func:`deepinfer.kernels.hc_expand`; ``block_d`` / ``num_warps`` override the
    launch (benchmark sweeps)."""
    if h.dim() != 3:
        raise ValueError(f"h: expected [T, nc, D], got shape {tuple(h.shape)}")
    t, nc, d = h.shape
    if f.shape != (t, d):
        raise ValueError(f"f: expected shape {(t, d)}, got {tuple(f.shape)}")
    h = h if h.stride(2) == 1 else h.contiguous()
    f = f if f.stride(1) == 1 else f.contiguous()
    post = _check_coeffs("post", t, (nc,), post)
    comb = _check_coeffs("comb", t, (nc, nc), comb)
    out = torch.empty(t, nc, d, dtype=h.dtype, device=h.device)
    if t == 0:
        return out
    bd = min(block_d or EXPAND_BLOCK_D, _block_d(d))
    args = (f, h, post, comb, out, d, f.stride(0), h.stride(0), h.stride(1))
    grid = (t, triton.cdiv(d, bd))
    if nc == 4:
        _hc_expand4_kernel[grid](*args, BD=bd, num_warps=num_warps or EXPAND_WARPS)
    else:
        _hc_expand_kernel[grid](*args, NC=nc, BD=bd, num_warps=num_warps or EXPAND_WARPS)
    return out
