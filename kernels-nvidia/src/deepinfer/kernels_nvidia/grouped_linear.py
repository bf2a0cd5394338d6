"""``grouped_linear`` (V4's grouped output projection ``wo_a``) in Triton.

``y[t, g, n] = sum_k x[t, g, k] * W[g * N + n, k]`` with ``W`` dense or FP8 with ue8m0 block
scales. The reference dequantises ``W`` to fp32 and multiplies without quantising ``x``; here each
weight tile is dequantised in registers to ``x``'s dtype (an e4m3 value times a power of two is
exact in bf16) and fed to the tensor cores with an fp32 accumulator, so only the summation order
differs from the reference. One program per (row tile, column tile, group); the tile choice
depends on nothing but the group's shape, so a row's result never depends on the batch.

Prefill-sized calls (``BF16_ROUTE_TOKENS`` rows or more, bf16 ``x``) outside batch-invariant mode
take the bf16 route instead: the weight dequantised once per call to bf16 (exact, as above), then
one batched cuBLAS GEMM over the groups with an fp32 accumulator. Same math, another summation
order; the dequantised copy is re-read by every row tile, where the Triton kernel re-dequantises
each weight tile for every row tile it meets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import OPS, envs
from deepinfer.kernels_nvidia.gemm.bf16 import dequantize_to_bf16
from deepinfer.kernels_nvidia.registry import implements

_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
BF16_ROUTE_TOKENS = 512  # rows from which the bf16 route runs (batch invariance off)


@triton.jit
def _grouped_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, T, N, K,
    stride_xt, stride_xg, stride_xk, stride_wn, stride_sn, stride_yt, stride_yg,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < T, offs_n < N
    rows_w = (group * N + tl.where(n_mask, offs_n, 0)).to(tl.int64)
    x_rows = x_ptr + tl.where(m_mask, offs_m, 0).to(tl.int64)[:, None] * stride_xt
    x_rows += group.to(tl.int64) * stride_xg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :])
        w = tl.load(
            w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_SCALE:  # one ue8m0 byte per (SCALE_N rows, SCALE_K columns); BLOCK_K | SCALE_K
            byte = tl.load(s_ptr + (rows_w // SCALE_N) * stride_sn + k0 // SCALE_K)
            w = w * (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, None]
        if IEEE:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + group.to(tl.int64) * stride_yg
    tl.store(
        y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :]
    )


def _check(x, weight, scale, block_size) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"grouped_linear x: expected [T, G, K], got shape {tuple(x.shape)}")
    tokens, groups, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or weight.shape[0] % groups:
        raise ValueError(
            f"grouped_linear weight: expected [G * N, {k}] with G={groups}, "
            f"got {tuple(weight.shape)}"
        )
    if scale is not None and (weight.dtype != torch.float8_e4m3fn or block_size is None):
        raise ValueError(
            "grouped_linear scale: expected an float8_e4m3fn weight and block_size, "
            f"got weight {weight.dtype}, block_size {block_size}"
        )
    return tokens, groups, weight.shape[0] // groups


@implements("grouped_linear")
def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    tokens, groups, n = _check(x, weight, scale, block_size)
    k = x.shape[2]
    supported = x.dtype in _TENSOR_CORE_DTYPES + (torch.float32,)
    if not supported or (scale is None and weight.dtype != x.dtype):
        return OPS["grouped_linear"].reference(x, weight, scale, block_size=block_size)
    weight = weight.contiguous()
    if _takes_bf16_route(x, weight, scale, block_size, tokens):
        return _bf16_route(x, weight, scale, block_size, groups, n)
    y = torch.empty(tokens, groups, n, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    scale_n, scale_k = block_size if scale is not None else (1, 1)
    block_k = 128 if scale is None else min(128, scale_k)
    scale_bytes = scale.view(torch.uint8) if scale is not None else weight
    block_m, block_n = (16, 64) if tokens <= 16 else (64, 64)
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(n, block_n), groups)
    _grouped_linear_kernel[grid](
        x, weight, scale_bytes, y, tokens, n, k,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0),
        scale_bytes.stride(0), y.stride(0), y.stride(1),
        SCALE_N=scale_n, SCALE_K=scale_k, HAS_SCALE=scale is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return y


def _takes_bf16_route(x, weight, scale, block_size, tokens: int) -> bool:
    if tokens < BF16_ROUTE_TOKENS or x.dtype != torch.bfloat16 or envs.batch_invariant():
        return False
    if scale is None:
        return weight.dtype == torch.bfloat16
    return x.shape[2] % max(128, block_size[1]) == 0  # dequantize_to_bf16's column tiles


def _bf16_route(x, weight, scale, block_size, groups: int, n: int) -> torch.Tensor:
    """``[T, G, K] x [G * N, K]^T`` per group: bf16 weight (dequantised once), one batched
    GEMM, the result laid out ``[T, G, N]`` like the kernel's."""
    if scale is not None:
        weight = dequantize_to_bf16(weight, scale.view(torch.uint8), tuple(block_size))
    y = torch.bmm(x.transpose(0, 1), weight.view(groups, n, -1).transpose(1, 2))
    return y.transpose(0, 1).contiguous()
