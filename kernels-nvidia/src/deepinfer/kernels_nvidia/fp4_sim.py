"""``fp4_sim``: the FP4 (e2m1) round trip per block of the last dim, in Triton (the indexer's
query/key rounding, V4.1's compressed latent).

Bit-exact with the reference: the scale is ``2^ceil(log2(max(amax, floor) / 6))`` read off the
fp32 bits (ue8m0) or ``max(amax, floor) / 6`` rounded to e4m3 by hand (normal numbers keep three
mantissa bits, round half to even; subnormals are multiples of ``2^-9``); divisions are IEEE
round-to-nearest (``tl.div_rn``); the e2m1 rounding compares against the midpoints with the
reference's tie rules. One program handles ``BLOCK`` consecutive blocks of ``GROUP`` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import OPS
from deepinfer.kernels.reference.quant import FP4_E4M3_AMAX_FLOOR, FP4_UE8M0_AMAX_FLOOR
from deepinfer.kernels_nvidia.registry import implements

_SCALE_FMTS = ("ue8m0", "e4m3")


@triton.jit
def _e2m1_magnitude(m):
    """|x / s| clamped to 6 -> the e2m1 magnitude it rounds to (ties to the even code)."""
    v = tl.where(m > 0.25, 0.5, 0.0)
    v = tl.where(m >= 0.75, 1.0, v)
    v = tl.where(m > 1.25, 1.5, v)
    v = tl.where(m >= 1.75, 2.0, v)
    v = tl.where(m > 2.5, 3.0, v)
    v = tl.where(m >= 3.5, 4.0, v)
    return tl.where(m > 5.0, 6.0, v)


@triton.jit
def _e4m3_round(v):
    """Positive fp32 in [2^-9, 448] -> the nearest e4m3 value (half to even), as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    half_even = ((bits >> 20) & 1) + 0x7FFFF
    normal = ((bits + half_even) & ~0xFFFFF).to(tl.float32, bitcast=True)
    sub = (v + 16384.0) - 16384.0  # fp32 ulp at 2^14 is 2^-9: rounds to a multiple of 2^-9
    return tl.where(v < 0.015625, sub, normal)


@triton.jit
def _fp4_sim_kernel(
    x_ptr, out_ptr, n_blocks, FLOOR: tl.constexpr, E4M3: tl.constexpr,
    GROUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    blocks = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (blocks < n_blocks)[:, None]
    offs = blocks[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
    ratio = tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    if E4M3:
        scale = _e4m3_round(tl.minimum(ratio, 448.0))
    else:
        bits = ratio.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    q = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    magnitude = _e2m1_magnitude(tl.minimum(tl.abs(q), 6.0))
    value = tl.where(q < 0, -magnitude, magnitude) * scale[:, None]
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


@implements("fp4_sim")
def fp4_sim(
    x: torch.Tensor,
    block_size: int,
    *,
    scale_fmt: str = "ue8m0",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r}: expected 'ue8m0' or 'e4m3'")
    if block_size <= 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"block_size={block_size}: expected a positive size dividing the last dim of x "
            f"(shape {tuple(x.shape)})"
        )
    if block_size & (block_size - 1):  # the kernel's tiles are powers of two
        return OPS["fp4_sim"].reference(x, block_size, scale_fmt=scale_fmt, out=out)
    src = x.contiguous()
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(
            f"out: expected shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    dst = out if out is not None and out.is_contiguous() else torch.empty_like(src)
    n_blocks = src.numel() // block_size
    if n_blocks:
        e4m3 = scale_fmt == "e4m3"
        floor = FP4_E4M3_AMAX_FLOOR if e4m3 else FP4_UE8M0_AMAX_FLOOR
        block = max(1, 2048 // block_size)
        grid = (triton.cdiv(n_blocks, block),)
        _fp4_sim_kernel[grid](
            src, dst, n_blocks, FLOOR=floor, E4M3=e4m3, GROUP=block_size, BLOCK=block, num_warps=4
        )
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst
