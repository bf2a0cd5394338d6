"""FP8 x FP8 block-scaled GEMM (``fp8_gemm_nt``) and the FP8-weight path of ``linear``, in Triton.

``c[m, n] = sum_k a[m, k] sa[m, k // ga] * b[n, k] sb[n // bn, k // bk]``. The K loop walks
``BLOCK_K`` columns at a time in sub-blocks of ``SUB_K = min(ga, bk)`` columns that share one scale
per row of a and per row of b: each sub-block is one FP8 tensor-core dot, promoted into the fp32
accumulator with its scales (so the tensor core's short internal accumulation spans at most one
scale block, as in DeepGEMM).

Tiles (:func:`choose_tiles`): one 64 x 128 configuration with grouped ordering serves every M
(measured fastest on the H200 for prefill and most decode shapes), so a row's result does not
depend on the batch; for small M with V4.1's 32-column scale blocks and few N tiles, narrow N
tiles plus a split-K into fp32 partials (summed in a fixed order, split chosen from N and K
only) keep enough programs streaming the weight. ``DEEPINFER_BATCH_INVARIANT=1`` never splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels import OPS, envs
from deepinfer.kernels_nvidia.quant import quantize_rows
from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def e8m0_to_fp32(byte):
    """ue8m0 bytes (uint8) -> fp32 ``2^(byte - 127)`` (bytes 1..254)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_a = tl.where(m_mask, offs_m, 0).to(tl.int64)
    rows_b = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, SUB_K)
    a_base = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    as_base = as_ptr + rows_a * stride_asm
    bs_base = bs_ptr + (rows_b // B_BLOCK_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = K // SPLIT_K
    for k0 in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        for kk in tl.static_range(BLOCK_K // SUB_K):
            k = k0 + kk * SUB_K
            a = tl.load(a_base + k)
            b = tl.load(b_base + k)
            sa = tl.load(as_base + k // A_GROUP)
            sb = e8m0_to_fp32(tl.load(bs_base + k // B_BLOCK_K))
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    c_ptr += split.to(tl.int64) * M * stride_cm  # split-K partials: [SPLIT_K, M, N] fp32
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c, mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k: int = 1


NUM_SMS_TARGET = 264  # two programs per H200 SM
# Measured on the H200 (benchmarks/kernels/bench_gemm.py, commit aa2fb25): 64 x 128 tiles, 4 warps,
# 4 stages beat 128 x 128 / 8 warps at every prefill shape (V4 +20%, V4.1 2x) and the split-K
# decode tiles at 24 of 30 shapes; split-K won only for V4.1's 32-column scale blocks at small N.
UNIFORM_TILES = GemmTiles(64, 128, 8, 4, 4)


def choose_tiles(
    m: int, n: int, k: int, sub_k: int = 128, *, batch_invariant: bool, on_cpu: bool
) -> GemmTiles:
    """Tile shape for an ``m x n x k`` product whose scales change every ``sub_k`` columns.

    One configuration serves every M (so results are batch invariant by default); only small M
    with fine scale blocks and few N tiles streams through a split-K that depends on
    ``(n, k)`` alone, and batch-invariant mode never splits.
    """
    if on_cpu:  # the interpreter: few big programs
        return GemmTiles(32, 64, 8, 4, 1)
    if batch_invariant or m > 64 or sub_k >= 128 or triton.cdiv(n, 128) >= 32:
        return UNIFORM_TILES
    programs = triton.cdiv(n, 64)
    split = 1
    while programs * split < NUM_SMS_TARGET and k % (split * 2 * 512) == 0:
        split *= 2
    return GemmTiles(64, 64, 1, 4, 6, split)


def _check_operands(a, a_scale, b, b_scale, block_size):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}: expected [M, K] and [N, K]")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a, b dtypes {a.dtype}, {b.dtype}: expected float8_e4m3fn")
    m, k = a.shape
    n = b.shape[0]
    if a_scale.shape[0] != m or a_scale.shape[1] == 0 or k % a_scale.shape[1]:
        raise ValueError(f"a_scale {tuple(a_scale.shape)}: expected [{m}, K / g] dividing K={k}")
    bn, bk = block_size
    want = (-(-n // bn), -(-k // bk))
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale {tuple(b_scale.shape)}: expected {want} for block {block_size}")
    a_group = k // a_scale.shape[1]
    sub_k = min(a_group, bk)
    if sub_k < 16 or k % sub_k:
        raise ValueError(f"scale blocks a_group={a_group}, bk={bk}: expected >= 16 dividing K={k}")
    return m, n, k, a_group, sub_k


@implements("fp8_gemm_nt")
def fp8_gemm_nt(a, a_scale, b, b_scale, block_size, *, out_dtype=torch.bfloat16):
    return fp8_gemm_nt_tiles(a, a_scale, b, b_scale, block_size, out_dtype=out_dtype)


def fp8_gemm_nt_tiles(a, a_scale, b, b_scale, block_size, *, out_dtype, tiles=None):
    """:func:`fp8_gemm_nt` with an explicit tile shape (``None``: :func:`choose_tiles`)."""
    m, n, k, a_group, sub_k = _check_operands(a, a_scale, b, b_scale, block_size)
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    a_scale = a_scale.float()
    b_scale = b_scale.view(torch.uint8)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if tiles is None:
        on_cpu = a.device.type == "cpu"
        invariant = envs.batch_invariant()
        tiles = choose_tiles(m, n, k, sub_k, batch_invariant=invariant, on_cpu=on_cpu)
    block_k = max(sub_k, 128) if k % (max(sub_k, 128) * tiles.split_k) == 0 else sub_k
    if k % (block_k * tiles.split_k):
        raise ValueError(f"K={k}: split_k={tiles.split_k} x block_k={block_k} must divide it")
    split = tiles.split_k
    c = torch.empty(
        (split, m, n) if split > 1 else (m, n),
        dtype=torch.float32 if split > 1 else out_dtype,
        device=a.device,
    )
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), split)
    _fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, m, n, k,
        a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0), n,
        A_GROUP=a_group, B_BLOCK_N=block_size[0], B_BLOCK_K=block_size[1], SUB_K=sub_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, GROUP_M=tiles.group_m,
        SPLIT_K=split, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return c.sum(0).to(out_dtype) if split > 1 else c


@implements("linear")
def linear(
    x, weight, scale=None, *, block_size=None, act_quant_group=None, out_dtype=None
):  # fmt: skip
    """FP8 block weights with FP8 activation quantisation run the Triton GEMM; every other
    weight format (dense, FP4, FP8 without activation quantisation) runs the reference."""
    is_fp8_path = (
        weight.dtype == torch.float8_e4m3fn
        and scale is not None
        and act_quant_group is not None
        and x.shape[-1] % act_quant_group == 0
        and act_quant_group in (16, 32, 64, 128, 256)
    )
    if not is_fp8_path:
        return OPS["linear"].reference(
            x, weight, scale, block_size=block_size, act_quant_group=act_quant_group,
            out_dtype=out_dtype,
        )  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    xq, xs = quantize_rows(x2, act_quant_group)
    y = fp8_gemm_nt(xq, xs, weight, scale, tuple(block_size), out_dtype=out_dtype or x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])
