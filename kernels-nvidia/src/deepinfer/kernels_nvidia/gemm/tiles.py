"""The tiled FP8 block-scaled GEMM kernel (prefill and the batch-invariant path of ``fp8_gemm_nt``).

``c[m, n] = sum_k a[m, k] sa[m, k // ga] * b[n, k] sb[n // bn, k // bk]``. Each program owns a
``BLOCK_M x BLOCK_N`` output tile; the K loop walks ``BLOCK_K`` columns per pipeline stage in
sub-blocks of ``SUB_K = min(ga, bk)`` columns that share one scale per row of a and per row of b.
Each sub-block is one FP8 tensor-core dot into a fresh accumulator, promoted into the fp32 tile
with its scales (the tensor core's short internal accumulation then spans one scale block, as in
DeepGEMM). When a tile's columns sit inside one weight block (``BLOCK_N <= bn``) the weight scale
is one number per K step, so the promotion is one FMA per element with a per-row factor.

Variants (compile-time): operands through TMA tensor descriptors (host-built, zero-padded at the
edges) or plain pointer loads, and a persistent grid (``PERSISTENT``: a fixed number of programs
loop over the tiles in grouped order) or one program per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def e8m0_to_fp32(byte):
    """ue8m0 bytes (uint8) -> fp32 ``2^(byte - 127)`` (bytes 1..254)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: ``GROUP_M`` row tiles sweep the N tiles together (L2 reuse of b)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gemm_tile(
    a_src, as_ptr, b_src, bs_ptr, c_ptr, pid_m, pid_n, M, N, K,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
    A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_a = tl.where(m_mask, offs_m, 0).to(tl.int64)
    rows_b = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, SUB_K)
    as_base = as_ptr + rows_a * stride_asm
    if B_BLOCK_N % BLOCK_N == 0:  # the tile's columns lie in one weight block
        bs_base = bs_ptr + ((pid_n * BLOCK_N) // B_BLOCK_N).to(tl.int64) * stride_bsn
    else:
        bs_base = bs_ptr + (rows_b // B_BLOCK_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for kk in tl.static_range(BLOCK_K // SUB_K):
            k = k0 + kk * SUB_K
            if USE_TMA:
                a = a_src.load([pid_m * BLOCK_M, k])
                b = b_src.load([pid_n * BLOCK_N, k])
            else:
                a = tl.load(a_src + rows_a[:, None] * stride_am + (k + offs_k)[None, :])
                b = tl.load(b_src + rows_b[:, None] * stride_bn + (k + offs_k)[None, :])
            sa = tl.load(as_base + (k // A_GROUP) * stride_ask)
            sb = e8m0_to_fp32(tl.load(bs_base + k // B_BLOCK_K))
            d = tl.dot(a, tl.trans(b))
            if B_BLOCK_N % BLOCK_N == 0:
                acc += d * (sa * sb)[:, None]
            else:
                acc += d * sa[:, None] * sb[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def fp8_gemm_tile_kernel(
    a_src, as_ptr, b_src, bs_ptr, c_ptr, M, N, K,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
    A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, num_programs, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if not PERSISTENT:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
        _gemm_tile(
            a_src, as_ptr, b_src, bs_ptr, c_ptr, pid_m, pid_n, M, N, K,
            stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
            A_GROUP, B_BLOCK_N, B_BLOCK_K, SUB_K, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA,
        )  # fmt: skip
    else:
        for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            _gemm_tile(
                a_src, as_ptr, b_src, bs_ptr, c_ptr, pid_m, pid_n, M, N, K,
                stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_cm,
                A_GROUP, B_BLOCK_N, B_BLOCK_K, SUB_K, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA,
            )  # fmt: skip


@dataclass(frozen=True)
class GemmTiles:
    """One launch configuration of :func:`fp8_gemm_tiled`.

    ``block_k``: K columns per pipeline stage (a multiple of the scale sub-block); ``use_tma``:
    operands through tensor descriptors; ``programs_per_sm``: 0 for one program per tile, else a
    persistent grid of that many programs per SM (``flatten``: one software pipeline across the
    tile and K loops); ``a_scale_k_major``: read a's scales from a
    ``[K / g, M]`` copy (contiguous per K step) instead of the ``[M, K / g]`` input.
    """

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    block_k: int = 128
    use_tma: bool = False
    programs_per_sm: int = 0
    a_scale_k_major: bool = False
    flatten: bool = False


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a persistent grid still loops over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_descriptor(x: torch.Tensor, block_shape: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], block_shape)


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides (fp8: stride % 16 == 0)."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def fp8_gemm_tiled(a, a_scale, b, b_scale, block_size, a_group, sub_k, tiles, out_dtype):
    """Launch :func:`fp8_gemm_tile_kernel` (operands already checked; ``b_scale`` as uint8)."""
    m, k = a.shape
    n = b.shape[0]
    block_k = tiles.block_k if k % tiles.block_k == 0 and tiles.block_k % sub_k == 0 else sub_k
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if tiles.a_scale_k_major:
        a_scale = a_scale.t().contiguous()
        stride_asm, stride_ask = 1, a_scale.stride(0)
    else:
        stride_asm, stride_ask = a_scale.stride(0), a_scale.stride(1)
    a_src, b_src = a, b
    if tiles.use_tma:
        a_src = _tma_descriptor(a, [tiles.block_m, sub_k])
        b_src = _tma_descriptor(b, [tiles.block_n, sub_k])
    num_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    programs = 0
    if tiles.programs_per_sm:
        programs = min(num_tiles, tiles.programs_per_sm * _num_sms(a.device))
    fp8_gemm_tile_kernel[(programs or num_tiles,)](
        a_src, a_scale, b_src, b_scale, c, m, n, k,
        a.stride(0), stride_asm, stride_ask, b.stride(0), b_scale.stride(0), n,
        A_GROUP=a_group, B_BLOCK_N=block_size[0], B_BLOCK_K=block_size[1], SUB_K=sub_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, GROUP_M=tiles.group_m,
        USE_TMA=tiles.use_tma, num_programs=max(programs, 1), PERSISTENT=programs > 0,
        FLATTEN=tiles.flatten,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return c
