"""FP8 block-scaled GEMM through bf16 for fine (32-column) scale blocks at large M.

With V4.1's 32 x 32 weight blocks and group-32 activations, an FP8 tensor-core GEMM must promote
its fp32 accumulator every 32 K columns: two CUDA-core operations per output element per 32 K
columns against 64 tensor-core FLOPs, which bounds it well under the bf16 rate (see
``benchmarks/kernels/bench_gemm.py``). Dequantising both operands to bf16 is exact (an e4m3
value times a power of two fits bf16's 8-bit mantissa and exponent range), every product of two
such bf16 values is exact in fp32, and the bf16 tensor-core GEMM accumulates in fp32: the same
math as the reference up to fp32 summation order, at the bf16 rate, for the price of writing
and re-reading the operands once in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.gemm.tiles import e8m0_to_fp32


@triton.jit
def _dequant_bf16_kernel(
    q_ptr, s_ptr, out_ptr, R, K, stride_q, stride_sr, stride_sk,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, SCALE_E8M0: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_R, BLOCK_C]`` tile; its ``BLOCK_C / COL_BLOCK`` scales per row are loaded once
    and broadcast over their column groups (``BLOCK_C`` a multiple of ``COL_BLOCK``, K of both)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * BLOCK_C
    cols = col0 + tl.arange(0, BLOCK_C)
    groups = col0 // COL_BLOCK + tl.arange(0, BLOCK_C // COL_BLOCK)
    row_mask = rows < R
    rows64 = tl.where(row_mask, rows, 0).to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * stride_q + cols[None, :])
    s_ptrs = s_ptr + (rows64 // ROW_BLOCK)[:, None] * stride_sr + groups[None, :] * stride_sk
    if SCALE_E8M0:
        s = e8m0_to_fp32(tl.load(s_ptrs))
    else:
        s = tl.load(s_ptrs)
    v = tl.reshape(q.to(tl.float32), (BLOCK_R, BLOCK_C // COL_BLOCK, COL_BLOCK))
    v = tl.reshape(v * s[:, :, None], (BLOCK_R, BLOCK_C))
    out_ptrs = out_ptr + rows64[:, None] * K + cols[None, :]
    tl.store(out_ptrs, v.to(tl.bfloat16), mask=row_mask[:, None])


def dequantize_to_bf16(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``[R, K]`` e4m3 times its block scales -> contiguous ``[R, K]`` bf16 (exact).

    ``scale``: ``[ceil(R / block[0]), K / block[1]]`` fp32, or uint8 ue8m0 bytes.
    """
    r, k = q.shape
    block_r, block_c = 32, max(128, block[1])
    if k % block_c:
        raise ValueError(f"K={k}: expected a multiple of {block_c} (128 and the scale block)")
    out = torch.empty((r, k), dtype=torch.bfloat16, device=q.device)
    grid = (triton.cdiv(r, block_r), triton.cdiv(k, block_c))
    _dequant_bf16_kernel[grid](
        q, scale, out, r, k, q.stride(0), scale.stride(0), scale.stride(1),
        ROW_BLOCK=block[0], COL_BLOCK=block[1], SCALE_E8M0=scale.dtype == torch.uint8,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out


def fp8_gemm_via_bf16(a, a_scale, b, b_scale, block_size, a_group):
    """``(a * a_scale) @ (b * b_scale)^T`` in bf16 (``b_scale`` as uint8): dequantise both
    operands, then one bf16 GEMM with fp32 accumulation and a bf16 result."""
    a16 = dequantize_to_bf16(a, a_scale, (1, a_group))
    b16 = dequantize_to_bf16(b, b_scale, tuple(block_size))
    return torch.mm(a16, b16.t())
