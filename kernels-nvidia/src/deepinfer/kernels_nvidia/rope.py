"""Partial interleaved RoPE (and its inverse) in Triton.

One program handles a block of heads of one row: the leading ``D - rd`` channels pass through
(copied unless the call is in place), the trailing ``rd / 2`` interleaved pairs are rotated by
the row's angles in fp32, read and written as one contiguous tile. The stores cover disjoint
channels, so no ordering between them is needed; in place, each program reads its pairs before
it overwrites them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference.rope import same_view
from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    num_heads, dim, half, stride_xn, stride_xh, stride_on, stride_oh, stride_cn, stride_sn,
    INVERSE: tl.constexpr, PASSTHROUGH: tl.constexpr, HB: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = heads < num_heads
    passthrough = dim - 2 * half
    x_row = x_ptr + n * stride_xn + heads[:, None] * stride_xh
    o_row = out_ptr + n * stride_on + heads[:, None] * stride_oh
    if PASSTHROUGH:
        cols = tl.arange(0, BLOCK_D)
        keep = hmask[:, None] & (cols < passthrough)[None, :]
        tl.store(o_row + cols[None, :], tl.load(x_row + cols[None, :], mask=keep), mask=keep)

    # the rotary channels as one contiguous [HB, 2 * BLOCK_R] tile (whole sectors per access),
    # split into the interleaved pairs' even and odd halves in registers
    pairs = tl.arange(0, BLOCK_R)
    pmask = pairs < half
    cos = tl.load(cos_ptr + n * stride_cn + pairs, mask=pmask, other=1.0)
    sin = tl.load(sin_ptr + n * stride_sn + pairs, mask=pmask, other=0.0)
    if INVERSE:
        sin = -sin
    cols = passthrough + tl.arange(0, 2 * BLOCK_R)
    m2 = hmask[:, None] & (tl.arange(0, 2 * BLOCK_R) < 2 * half)[None, :]
    tile = tl.load(x_row + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(tile, (HB, BLOCK_R, 2)))
    ya = a * cos[None, :] - b * sin[None, :]
    yb = a * sin[None, :] + b * cos[None, :]
    y = tl.reshape(tl.join(ya, yb), (HB, 2 * BLOCK_R))
    tl.store(o_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m2)


def _rows(t: torch.Tensor, n: int, dim: int) -> torch.Tensor | None:
    """``t`` as a ``[N, H, D]`` view with unit channel stride, or None if it has none."""
    try:
        t3 = t.view(n, -1, dim)
    except RuntimeError:
        return None
    return t3 if t3.stride(2) == 1 or dim == 1 else None


@implements("apply_rope")
def apply_rope(x, cos, sin, *, inverse=False, out=None):
    if x.dim() < 2:
        raise ValueError(f"x: expected [N, ..., D], got shape {tuple(x.shape)}")
    n, dim = x.shape[0], x.shape[-1]
    if cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape:
        raise ValueError(
            f"cos/sin: expected [{n}, rd/2] each, got {tuple(cos.shape)}/{tuple(sin.shape)}"
        )
    half = cos.shape[1]
    if 2 * half > dim:
        raise ValueError(f"cos: rd = {2 * half} rotary dims exceed the head dim {dim}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(
            f"out: expected {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    in_place = out is not None and same_view(out, x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3, out3 = _rows(x, n, dim), _rows(out, n, dim)
    if out3 is None or (in_place and x3 is None):  # no [N, H, D] view to write through
        return out.copy_(apply_rope(x, cos, sin, inverse=inverse))
    if x3 is None:
        x3 = x.reshape(n, -1, dim).contiguous()
    heads = x3.shape[1]
    cos = cos.float() if cos.stride(1) == 1 else cos.float().contiguous()
    sin = sin.float() if sin.stride(1) == 1 else sin.float().contiguous()
    hb = min(16, triton.next_power_of_2(heads))
    _rope_kernel[(n, triton.cdiv(heads, hb))](
        x3, cos, sin, out3,
        heads, dim, half, x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        cos.stride(0), sin.stride(0),
        INVERSE=inverse, PASSTHROUGH=not in_place, HB=hb, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_R=max(1, triton.next_power_of_2(half)), num_warps=4,
    )  # fmt: skip
    return out
