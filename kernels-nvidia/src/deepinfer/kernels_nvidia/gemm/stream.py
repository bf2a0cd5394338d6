"""The streaming FP8 block-scaled GEMM for decode-sized M (<= 64): split-N, plus split-K when N is small.

Decode is a read of the weight: ``N x K`` FP8 bytes (plus 1/``bn*bk`` of scale bytes) against a
few activation rows. Each program streams a ``BLOCK_N x (K / split_k)`` slice of the weight in
``BLOCK_K``-column stages and computes ``c^T = b a^T`` with the weight rows as the tensor core's
M side (so 64 or 128 weight rows fill a tile whatever M is; the M side only pads to 16/32/64).

With ``split_k > 1`` the programs of one N slice write fp32 partials ``[split_k, M, N]``; the
last of them to finish (an acq_rel ticket counter per N slice) sums the partials in split order
0, 1, ... and writes the output, then resets the counter for the next call. The sum's order is
fixed, so results are deterministic; the split depends on ``(N, K)`` only (:func:`choose_split`),
so a row's result does not depend on M within this kernel.

With ``QUANT_A`` the kernel takes the unquantised activation (bf16 / fp32) and quantises each
``SUB_K``-column group as it loads it, with :func:`.quant.fp8_act_quant`'s rule (one launch less
per product; the activation is a few rows, so re-quantising it in every program costs little
beside the weight stream). The e4m3 values and scales are those of the separate quantiser, so
the output is bit for bit that of quantising first (a test).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.gemm.tiles import e8m0_to_fp32
from deepinfer.kernels_nvidia.quant import pow2_scale, to_e4m3


@triton.jit
def _stream_partial(
    a_ptr, as_ptr, b_ptr, bs_ptr, pid_n, split, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn,
    A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    split_k, QUANT_A: tl.constexpr, SOFT_ROUND: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_M]`` fp32: this program's K slice of ``c^T`` (``QUANT_A``: ``a`` is
    the unquantised activation, quantised here per ``SUB_K == A_GROUP`` columns)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, SUB_K)
    b_base = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    a_base = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    as_base = as_ptr + offs_m.to(tl.int64) * stride_asm
    if B_BLOCK_N % BLOCK_N == 0:
        bs_base = bs_ptr + ((pid_n * BLOCK_N) // B_BLOCK_N).to(tl.int64) * stride_bsn
    else:
        bs_base = bs_ptr + (rows_b // B_BLOCK_N) * stride_bsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    steps = K // BLOCK_K // split_k
    # K offsets as step * BLOCK_K, so the compiler sees 16-byte aligned rows and loads them
    # wide (a split-dependent start of unknown divisibility degrades them to byte loads).
    for step in range(split * steps, (split + 1) * steps):
        for kk in tl.static_range(BLOCK_K // SUB_K):
            k = tl.multiple_of(step * BLOCK_K + kk * SUB_K, SUB_K)
            b = tl.load(b_base + k)
            a = tl.load(a_base + k, mask=m_mask[:, None], other=0.0)
            if QUANT_A:
                x = a.to(tl.float32)
                sa = pow2_scale(tl.max(tl.abs(x), axis=1), 1e-4, 448.0)  # as the quantiser
                a = to_e4m3(x / sa[:, None], SOFT_ROUND)
            else:
                sa = tl.load(as_base + k // A_GROUP, mask=m_mask, other=0.0)
            sb = e8m0_to_fp32(tl.load(bs_base + k // B_BLOCK_K))
            d = tl.dot(b, tl.trans(a))
            if B_BLOCK_N % BLOCK_N == 0:
                acc += d * (sa * sb)[None, :]
            else:
                acc += d * sb[:, None] * sa[None, :]
    return acc


@triton.jit
def fp8_gemm_stream_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, ticket_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    split_k, QUANT_A: tl.constexpr = False, SOFT_ROUND: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    acc = _stream_partial(
        a_ptr, as_ptr, b_ptr, bs_ptr, pid_n, split, M, N, K,
        stride_am, stride_asm, stride_bn, stride_bsn,
        A_GROUP, B_BLOCK_N, B_BLOCK_K, SUB_K, BLOCK_M, BLOCK_N, BLOCK_K, split_k,
        QUANT_A, SOFT_ROUND,
    )  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out_offs = offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    if split_k == 1:
        tl.store(c_ptr + out_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        part_offs = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(part_ptr + split.to(tl.int64) * M * N + part_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == split_k - 1:  # the last split of this N slice sums all, in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(split_k):
                part = part_ptr + s * M * N + part_offs
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(c_ptr + out_offs, total.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(ticket_ptr + pid_n, 0)


@dataclass(frozen=True)
class StreamTiles:
    """Launch configuration of :func:`fp8_gemm_stream`: ``block_n`` weight rows per program,
    ``block_k`` columns per stage, and the program count the split-K aims for."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    target_programs: int = 264


STREAM_TILES = StreamTiles()
MAX_M = 64


def choose_split(n: int, k: int, block_k: int, tiles: StreamTiles = STREAM_TILES) -> int:
    """Split-K factor from ``(n, k)`` only: double it while the grid is under the target and each
    split keeps whole ``block_k`` stages."""
    programs = triton.cdiv(n, tiles.block_n)
    split = 1
    while programs * split < tiles.target_programs and k % (split * 2 * block_k) == 0:
        split *= 2
    return split


_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed ticket counters, one per N slice, kept per (device, stream): each launch returns
    them to zero, so one buffer serves every call on a stream (and CUDA-graph replays)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


def fp8_gemm_stream(a, a_scale, b, b_scale, block_size, a_group, sub_k, out_dtype, tiles=None):
    """Launch :func:`fp8_gemm_stream_kernel` for ``M <= 64`` (operands checked, ``b_scale`` as
    uint8, contiguous K). ``a_scale=None``: ``a`` is the unquantised activation, quantised in
    the kernel per ``a_group`` columns (``a_group == sub_k``)."""
    tiles = tiles or STREAM_TILES
    quant_a = a_scale is None
    if quant_a and a_group != sub_k:
        raise ValueError(f"a_group={a_group}, sub_k={sub_k}: in-kernel quantisation needs equal")
    m, k = a.shape
    n = b.shape[0]
    if m > MAX_M:
        raise ValueError(f"M={m}: the streaming GEMM takes M <= {MAX_M}")
    block_k = tiles.block_k if k % tiles.block_k == 0 and tiles.block_k % sub_k == 0 else sub_k
    split = choose_split(n, k, block_k, tiles)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    num_n = triton.cdiv(n, tiles.block_n)
    part = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=a.device)
    tickets = _tickets(a.device, num_n) if split > 1 else part
    fp8_gemm_stream_kernel[(num_n, split)](
        a, a if quant_a else a_scale, b, b_scale, c, part, tickets, m, n, k,
        a.stride(0), 0 if quant_a else a_scale.stride(0), b.stride(0), b_scale.stride(0), n,
        A_GROUP=a_group, B_BLOCK_N=block_size[0], B_BLOCK_K=block_size[1], SUB_K=sub_k,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, split_k=split,
        QUANT_A=quant_a, SOFT_ROUND=quant_a and a.device.type == "cpu",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return c
