"""FP8 activation quantisation per token-group (ue8m0 scales) and its round trip, in Triton.

One program takes ``BLOCK_M`` rows of one group of ``GROUP`` contiguous elements: it reads each
element once and writes the e4m3 value (or the dequantised value) and one fp32 scale per group.
Groups never interact, so results are batch invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
TILE_ELEMENTS = 4096


@triton.jit
def to_bf16_rne(y):
    """fp32 -> bf16 rounded to nearest even on the bits, as torch's cast (finite values; the
    interpreter's own downcast truncates)."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def pow2_scale(amax, floor, qmax):
    """``2^ceil(log2(max(amax, floor) / qmax))`` exactly (fp32 bit arithmetic, normal inputs)."""
    ratio = tl.maximum(amax, floor) / qmax
    bits = ratio.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(v, SOFT_ROUND: tl.constexpr):
    """fp32 -> e4m3, saturating at +-448, round to nearest even.

    ``SOFT_ROUND`` first rounds in fp32 bit arithmetic so the cast is exact: the Triton
    interpreter's own cast drops mantissa carries (toolchain.md). Used on CPU tensors only.
    """
    v = tl.clamp(v, -448.0, 448.0)
    if SOFT_ROUND:
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        magic = 12582912.0  # 1.5 * 2^23: adding it rounds v * 2^9 to an integer, ties to even
        subnormal = ((v * 512.0 + magic) - magic) * 0.001953125
        v = tl.where(tl.abs(v) < 0.015625, subnormal, normal)
    return v.to(tl.float8e4nv)


@triton.jit
def to_bf16(v, SOFT_ROUND: tl.constexpr):
    """fp32 -> bf16, round to nearest even (``SOFT_ROUND``: in bit arithmetic, since the Triton
    interpreter truncates this cast). Finite inputs."""
    if SOFT_ROUND:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = bits.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, n_rows, stride_x, stride_q, stride_s, stride_sg,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, DEQUANT: tl.constexpr, SOFT_ROUND: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = pow2_scale(tl.max(tl.abs(x), axis=1), 1e-4, 448.0)
    q = to_e4m3(x / scale[:, None], SOFT_ROUND)
    if DEQUANT:
        y = q.to(tl.float32) * scale[:, None]
        tl.store(
            q_ptr + rows64[:, None] * stride_q + cols[None, :],
            y.to(q_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows64 * stride_s + group * stride_sg, scale, mask=row_mask)
    # fmt: skip


def _rows(x: torch.Tensor, group_size: int) -> torch.Tensor:
    k = x.shape[-1]
    if group_size not in (16, 32, 64, 128, 256) or k % group_size:
        raise ValueError(
            f"group_size={group_size}: expected a power of two in 16..256 dividing the last dim "
            f"of x (shape {tuple(x.shape)})"
        )
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, q2, s2, group_size, dequant):
    n_rows, k = x2.shape
    block_m = max(1, min(TILE_ELEMENTS // group_size, triton.next_power_of_2(max(n_rows, 1))))
    grid = (triton.cdiv(n_rows, block_m), k // group_size)
    if n_rows == 0:
        return
    _act_quant_kernel[grid](
        x2, q2, s2, n_rows, x2.stride(0), q2.stride(0), s2.stride(0), s2.stride(1),
        GROUP=group_size, BLOCK_M=block_m, DEQUANT=dequant, SOFT_ROUND=x2.device.type == "cpu",
        num_warps=4,
    )  # fmt: skip


def quantize_rows(
    x2: torch.Tensor, group_size: int, *, m_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` (unit column stride) -> (``[M, K]`` e4m3, ``[M, K / group]`` fp32); with
    ``m_major`` the scales are laid out with unit stride along M (what cuBLAS's blockwise GEMM
    reads, :mod:`.gemm.cublas`)."""
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
    m, groups = x2.shape[0], x2.shape[1] // group_size
    strides = (1, max(m, 1)) if m_major else (groups, 1)
    s = torch.empty_strided((m, groups), strides, dtype=torch.float32, device=x2.device)
    _launch(x2, q, s, group_size, dequant=False)
    return q, s


@implements("fp8_act_quant")
def fp8_act_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x, group_size)
    q, s = quantize_rows(x2, group_size)
    return q.view(x.shape), s.view(*x.shape[:-1], x.shape[-1] // group_size)


@implements("fp8_sim")
def fp8_sim(x: torch.Tensor, block_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _rows(x, block_size)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(
            f"out: expected shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    out2 = out.view(-1, x.shape[-1])
    _launch(x2, out2, out2, block_size, dequant=True)
    return out
