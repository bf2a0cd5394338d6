"""Compressor softmax pooling in Triton: one entry per window, a per-channel softmax over the
window's rows. One program holds a (window, channel block) tile whole in registers and reads
each projected row and gate logit once; ``compress_gather_pool`` loads the tile through the
window's row indices from the state pool and the step's rows (no gathered copy);
``write_state_rows`` copies the kept rows of kv and score into the state pool in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference import compressor as ref
from deepinfer.kernels.reference.compressor import check_gather_pool, check_state_rows
from deepinfer.kernels_nvidia.quant import to_bf16_rne
from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def _compress_pool_kernel(
    kv_ptr, score_ptr, out_ptr, window, dim,
    stride_ke, stride_kl, stride_se, stride_sl, stride_oe,
    BL: tl.constexpr, BD: tl.constexpr, TO_BF16: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    slots = tl.arange(0, BL)
    mask = (slots < window)[:, None] & (cols < dim)[None, :]
    score = tl.load(
        score_ptr + e * stride_se + slots[:, None] * stride_sl + cols[None, :],
        mask=mask,
        other=float("-inf"),
    ).to(tl.float32)
    kv = tl.load(
        kv_ptr + e * stride_ke + slots[:, None] * stride_kl + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    _pool_store(kv, score, out_ptr + e * stride_oe, cols, dim, TO_BF16)


@triton.jit
def _pool_store(kv, score, out_row, cols, dim, TO_BF16: tl.constexpr):
    """Softmax over axis 0 of ``score`` [BL, BD] (fp32, -inf: no slot), the weighted sum of
    ``kv``, stored at ``out_row + cols``."""
    peak = tl.max(score, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # masked-off channels only
    weight = tl.exp(score - peak[None, :])
    total = tl.sum(weight, axis=0)
    pooled = tl.sum(weight * kv, axis=0) / tl.where(cols < dim, total, 1.0)
    if TO_BF16:
        pooled = to_bf16_rne(pooled)
    tl.store(out_row + cols, pooled, mask=cols < dim)


@triton.jit
def _compress_gather_pool_kernel(
    first_kv_ptr, first_score_ptr, second_kv_ptr, second_score_ptr, rows_ptr, out_ptr,
    window, dim, split, stride_fk, stride_fs, stride_sk, stride_ss, stride_re, stride_oe,
    HALF: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr, TO_BF16: tl.constexpr,
):  # fmt: skip
    """One (window, channel block): the window's rows loaded through ``rows`` (< ``split``: the
    first source; -1: no slot); with ``HALF`` (overlap) slots from ``HALF`` on read the row's
    columns ``dim + c`` instead of ``c``."""
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    slots = tl.arange(0, BL)
    row = tl.load(rows_ptr + e * stride_re + slots, mask=slots < window, other=-1).to(tl.int64)
    exists = row >= 0
    in_first = exists & (row < split)
    in_second = exists & (row >= split)
    col = cols[None, :]
    if HALF > 0:
        col = col + tl.where(slots >= HALF, dim, 0)[:, None]
    cmask = (cols < dim)[None, :]
    first_rows = tl.where(in_first, row, 0)[:, None]
    second_rows = tl.where(in_second, row - split, 0)[:, None]
    m1 = in_first[:, None] & cmask
    m2 = in_second[:, None] & cmask
    k1 = tl.load(first_kv_ptr + first_rows * stride_fk + col, mask=m1, other=0.0)
    k2 = tl.load(second_kv_ptr + second_rows * stride_sk + col, mask=m2, other=0.0)
    kv = tl.where(m1, k1.to(tl.float32), k2.to(tl.float32))  # each source widened exactly
    s1 = tl.load(first_score_ptr + first_rows * stride_fs + col, mask=m1, other=0.0)
    s2 = tl.load(second_score_ptr + second_rows * stride_ss + col, mask=m2, other=0.0)
    score = tl.where(m1, s1.to(tl.float32), tl.where(m2, s2.to(tl.float32), float("-inf")))
    _pool_store(kv, score, out_ptr + e * stride_oe, cols, dim, TO_BF16)


@implements("compress_pool")
def compress_pool(kv, score, *, out_dtype=torch.float32):
    """A bf16 result is rounded in the kernel (:func:`.quant.to_bf16_rne`: exactly the separate
    cast it replaces); other narrow dtypes are cast after."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        return compress_pool(kv, score).to(out_dtype)
    if kv.dim() != 3:
        raise ValueError(f"kv: expected [E, L, d], got shape {tuple(kv.shape)}")
    if score.shape != kv.shape:
        raise ValueError(f"score: expected shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    kv = kv if kv.stride(2) == 1 else kv.contiguous()
    score = score if score.stride(2) == 1 else score.contiguous()
    num_entries, window, dim = kv.shape
    out = torch.empty(num_entries, dim, dtype=out_dtype, device=kv.device)
    if num_entries == 0 or dim == 0:
        return out
    bl = triton.next_power_of_2(max(window, 1))
    bd = max(16, min(triton.next_power_of_2(dim), 8192 // bl))
    _compress_pool_kernel[(num_entries, triton.cdiv(dim, bd))](
        kv, score, out, window, dim,
        kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), out.stride(0),
        BL=bl, BD=bd, TO_BF16=out_dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return out


@implements("compress_gather_pool")
def compress_gather_pool(
    first_kv, first_score, second_kv, second_score, rows, *, overlap=False,
    out_dtype=torch.float32,
):  # fmt: skip
    """The windows' rows loaded in the kernel through ``rows``; the same tile shape and
    arithmetic as :func:`compress_pool`, so the two agree bit for bit."""
    check_gather_pool(first_kv, first_score, second_kv, second_score, rows, overlap)
    # one float dtype for all four sources, else the reference: on the H100 the kernel's result
    # for a bf16 step beside the fp32 pool was not bit for bit compress_pool's (RESULTS.md)
    dtypes = {first_kv.dtype, second_kv.dtype, first_score.dtype, second_score.dtype}
    floats = {torch.float32, torch.bfloat16, torch.float16}
    if out_dtype not in (torch.float32, torch.bfloat16) or len(dtypes) > 1 or not dtypes <= floats:
        return ref.compress_gather_pool(
            first_kv, first_score, second_kv, second_score, rows, overlap=overlap,
            out_dtype=out_dtype,
        )  # fmt: skip
    sources = [t if t.stride(1) == 1 else t.contiguous()
               for t in (first_kv, first_score, second_kv, second_score)]  # fmt: skip
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    num_entries, window = rows.shape
    width = first_kv.shape[1]
    dim = width // 2 if overlap else width
    out = torch.empty(num_entries, dim, dtype=out_dtype, device=rows.device)
    if num_entries == 0 or dim == 0:
        return out
    bl = triton.next_power_of_2(max(window, 1))
    bd = max(16, min(triton.next_power_of_2(dim), 8192 // bl))
    fk, fs, sk, ss = sources
    _compress_gather_pool_kernel[(num_entries, triton.cdiv(dim, bd))](
        fk, fs, sk, ss, rows, out, window, dim, first_kv.shape[0],
        fk.stride(0), fs.stride(0), sk.stride(0), ss.stride(0), rows.stride(0), out.stride(0),
        HALF=window // 2 if overlap else 0, BL=bl, BD=bd, TO_BF16=out_dtype == torch.bfloat16,
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _write_state_rows_kernel(
    state_kv_ptr, state_score_ptr, dst_ptr, kv_ptr, score_ptr, src_ptr, width,
    stride_sk, stride_ss, stride_k, stride_s, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    d = tl.load(dst_ptr + i).to(tl.int64)
    s = tl.load(src_ptr + i).to(tl.int64)
    kv = tl.load(kv_ptr + s * stride_k + cols, mask=mask)
    tl.store(state_kv_ptr + d * stride_sk + cols, kv.to(state_kv_ptr.dtype.element_ty), mask=mask)
    score = tl.load(score_ptr + s * stride_s + cols, mask=mask)
    tl.store(state_score_ptr + d * stride_ss + cols, score.to(state_score_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@implements("write_state_rows")
def write_state_rows(state_kv, state_score, dst, kv, score, src):
    """One program per kept row and column block, both tensors in the same program."""
    check_state_rows(state_kv, state_score, dst, kv, score, src)
    if state_kv.stride(1) != 1 or state_score.stride(1) != 1:  # a view we cannot write through
        return ref.write_state_rows(state_kv, state_score, dst, kv, score, src)
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    score = score if score.stride(1) == 1 else score.contiguous()
    n, width = dst.shape[0], state_kv.shape[1]
    if n == 0 or width == 0:
        return state_kv, state_score
    block = min(1024, triton.next_power_of_2(width))
    _write_state_rows_kernel[(n, triton.cdiv(width, block))](
        state_kv, state_score, dst.contiguous(), kv, score, src.contiguous(), width,
        state_kv.stride(0), state_score.stride(0), kv.stride(0), score.stride(0), BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return state_kv, state_score
