"""fp32 activations times bf16 weights with fp32 accumulation (the LM head and the MoE router), in
Triton, without an fp32 copy of the weight.

The reference computes ``x_fp32 @ w.float().t()``: for the V4-Flash head (129,280 x 4,096 bf16)
that casts 1.06 GB of weight into a 2.1 GB fp32 temporary on every step and then runs an fp32
GEMM on the CUDA cores. Here each weight tile is read once as bf16 and the activations are split
exactly into three bf16 parts, ``x = hi + mid + lo`` (``hi = bf16(x)``, ``mid = bf16(x - hi)``,
``lo = bf16(x - hi - mid)``: 3 x 8 significant bits cover fp32's 24), so ``x . w`` is the sum of
three bf16 x bf16 tensor-core products, each exact in fp32. The tensor cores accumulate with
fewer bits than fp32 (on the H200 a product accumulated only inside the MMAs was about a
hundred times further from fp32 than cuBLAS's fp32 GEMM), so
each ``BLOCK_K`` block's products are summed from zero (the small parts first) and added into the
fp32 accumulator on the CUDA cores. Activations whose parts fall below bf16's normal range
(|x| < ~2^-110) lose those low bits; logits and router inputs are normalised activations, far
above that.

The weight rows are the product's M side (``out^T = w x^T``) and the activation rows are always
taken 16 at a time, so a row's result does not depend on how many rows the batch has (batch
invariant by construction); the programs of one weight tile run next to each other and share
its bytes through L2. A weight of few rows (the router: 256 x 4,096) would give a decode step
only a couple of programs, each walking all of K: its K is cut into ``splits`` chunks (a number
that depends on the weight's shape only, so rows stay batch invariant), each program sums one
chunk, and a second kernel adds the chunks' partials in chunk order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # activation rows per program (fixed: batch invariance)
BLOCK_N = 128
BLOCK_K = 64
SPLIT_PROGRAMS = 128  # programs per 16 activation rows that splitting K aims at


@triton.jit
def _f32_bf16_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, num_m, k_chunk, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_N weight rows, BLOCK_M activation rows]`` output tile over K chunk
    ``program_id(1)`` (written at ``out_ptr + chunk * stride_split``); programs are ordered
    activation tile fastest, so the tiles reading one weight tile run together."""
    pid = tl.program_id(0)
    k_start = tl.program_id(1) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    out_ptr += tl.program_id(1).to(tl.int64) * stride_split
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = rows_n < N
    mask_m = rows_m < M
    w_rows = tl.where(mask_n, rows_n, 0).to(tl.int64)
    x_rows = tl.where(mask_m, rows_m, 0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kmask = (k0 + cols) < k_end
        w = tl.load(w_ptr + w_rows[:, None] * stride_w + (k0 + cols)[None, :],
                    mask=kmask[None, :], other=0.0)  # fmt: skip
        # the activations transposed, [BLOCK_K, BLOCK_M] fp32
        x = tl.load(
            x_ptr + x_rows[None, :] * stride_x + (k0 + cols)[:, None],
            mask=kmask[:, None],
            other=0.0,
        )
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        # each K block's products start from zero accumulators and are added into ``acc`` on
        # the CUDA cores: the tensor cores' own accumulation keeps fewer bits than fp32, and
        # small parts summed into a large running value would lose theirs
        low = tl.dot(w, mid, tl.dot(w, lo))
        acc += tl.dot(w, hi) + low
    out = out_ptr + x_rows[None, :] * stride_o + w_rows[:, None]
    tl.store(out, acc, mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """``out = part[0] + part[1] + ...`` in chunk order (``part`` ``[splits, numel]``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


def k_splits(n: int, k: int) -> tuple[int, int]:
    """(chunks, chunk length) K is cut into for an ``[n, k]`` weight: about ``SPLIT_PROGRAMS``
    programs per activation tile, at least two ``BLOCK_K`` blocks per chunk; one chunk for a
    weight of many rows (the LM head)."""
    blocks = triton.cdiv(k, BLOCK_K)
    wanted = min(SPLIT_PROGRAMS // triton.cdiv(n, BLOCK_N), blocks // 2)
    if wanted < 2:
        return 1, blocks * BLOCK_K
    chunk = triton.cdiv(blocks, 1 << (wanted.bit_length() - 1)) * BLOCK_K
    return triton.cdiv(k, chunk), chunk


def linear_f32_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32 (unit column stride) times ``w [N, K]`` bf16 (unit column stride) ->
    fp32 ``[M, N]``."""
    if x.dtype != torch.float32 or w.dtype != torch.bfloat16:
        raise ValueError(f"x {x.dtype}, w {w.dtype}: expected float32 and bfloat16")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}, w {tuple(w.shape)}: expected [M, K] and [N, K]")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w: expected unit column stride")
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    num_m = triton.cdiv(m, BLOCK_M)
    splits, chunk = k_splits(n, k)
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=out.dtype, device=x.device)
    grid = (num_m * triton.cdiv(n, BLOCK_N), splits)
    _f32_bf16_kernel[grid](
        x, w, part, m, n, k, x.stride(0), w.stride(0), n, num_m, chunk, m * n,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, splits, BLOCK=block)
    return out


INVARIANT_BLOCK_M = 16  # activation rows per program (fixed: batch invariance)
INVARIANT_BLOCK_N = 64
INVARIANT_BLOCK_K = 32


# one compile per dtype: the engine calls it with many row counts and widths (the drafter's
# heads included), and specialising on each integer's divisibility recompiled per shape class
@triton.jit(do_not_specialize=["M", "N", "K", "stride_x", "stride_w", "stride_o"])
def _dense_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x w^T``, fp32 accumulation over K in fixed blocks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    w_rows = tl.where(col_mask, cols, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        x = tl.load(x_ptr + x_rows[:, None] * stride_x + (k0 + kk)[None, :],
                    mask=kmask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + w_rows[:, None] * stride_w + (k0 + kk)[None, :],
                    mask=kmask[None, :], other=0.0)  # fmt: skip
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + x_rows[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def matmul_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` in their shared float dtype (fp32 products exact, on the CUDA
    cores; 16-bit ones on the tensor cores), accumulated in fp32 over fixed tiles: a row's
    result never depends on the other rows (``torch.matmul`` picks its kernel, and with it the
    summation order, by the number of rows)."""
    if x.dtype != w.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x {x.dtype}, w {w.dtype}: expected one of fp32 / bf16 / fp16")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)}, w {tuple(w.shape)}: expected [M, K] and [N, K]")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, INVARIANT_BLOCK_M), triton.cdiv(n, INVARIANT_BLOCK_N))
    _dense_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=INVARIANT_BLOCK_N, BLOCK_K=INVARIANT_BLOCK_K,
        IEEE=x.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
