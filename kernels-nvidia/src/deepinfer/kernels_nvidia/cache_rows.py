"""``pack_rows``: float rows into the cache's row formats (:mod:`deepinfer.kernels.formats`) in
one Triton kernel, optionally scattered straight to destination rows of a cache tensor;
``unpack_rows``: packed rows back to float rows in one kernel (the decoding of
:func:`~deepinfer.kernels_nvidia.attention_rows.load_packed`, which the attention and indexer
kernels read packed rows with).

Bit-exact with the reference without trusting the hardware's float rounding modes: block
maxima are taken on the integer bits, a power-of-two scale divides by subtracting from the
exponent field (a subnormal input goes through an exact int-to-float conversion), e4m3 and
e2m1 codes are rounded in integer arithmetic (half to even) and only the e4m3-scaled FP4 format
divides in floating point, with IEEE division (``tl.div_rn``). One program packs ``ROWS`` rows;
rows never interact, so the bytes of a row do not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import OPS, RowFormat
from deepinfer.kernels.reference.cache_rows import check_write_args
from deepinfer.kernels.reference.quant import (
    FP4_E4M3_AMAX_FLOOR,
    FP4_UE8M0_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
)
from deepinfer.kernels_nvidia.attention_rows import TAIL_DTYPES, load_packed
from deepinfer.kernels_nvidia.quant import to_bf16
from deepinfer.kernels_nvidia.registry import implements

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_TILE_ELEMENTS = 2048
_MIN_PROGRAMS = 256  # spread small batches (decode) over the SMs before packing rows per program


@triton.jit
def _e4m3_code(m):
    """fp32 magnitudes in [0, 448] -> e4m3 codes (int32 0..126), round half to even."""
    bits = m.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    magic = 12582912.0  # 1.5 * 2^23: the sum rounds m * 2^9 to an integer, ties to even
    sub = ((m * 512.0 + magic) - magic).to(tl.int32)
    return tl.where(m < 0.015625, sub, normal)


@triton.jit
def _e4m3_value(code):
    """Positive e4m3 codes (int32) -> their fp32 values."""
    exponent = code >> 3
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    return tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e2m1_code(m):
    """fp32 magnitudes -> e2m1 magnitude codes (int32 0..7), saturating at 6, ties to even."""
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    code += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
    return code + (m > 5.0).to(tl.int32)


@triton.jit
def _pow2_exponent(amax, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """``ceil(log2(max(amax, FLOOR) / QMAX))`` (int32), the quotient rounded as in fp32."""
    ratio = tl.div_rn(tl.maximum(amax, FLOOR), tl.full(amax.shape, QMAX, tl.float32))
    bits = ratio.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _unscale_pow2(mag, k):
    """``|x| / 2^k`` from the magnitude bits ``mag`` (int32): exact where the quotient is a
    normal fp32 number, else 0 (below 2^-126, which every code grid rounds to zero)."""
    biased = mag >> 23
    normal = (mag - (k << 23)).to(tl.float32, bitcast=True)
    # a subnormal |x| is mag * 2^-149; 2^(-149 - k) is a normal fp32 number when k <= -23
    step = ((tl.maximum(-22 - k, 1)) << 23).to(tl.float32, bitcast=True)
    sub = tl.where(k <= -23, mag.to(tl.float32) * step, 0.0)
    return tl.where(biased == 0, sub, tl.where(biased > k, normal, 0.0))


@triton.jit
def _quantised(x, scale, k, E4M3S: tl.constexpr, QMAX: tl.constexpr):
    """|x / scale| clamped to QMAX, and the sign bits of x (int32 0/1)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    if E4M3S:
        q = tl.div_rn(mag.to(tl.float32, bitcast=True), scale)
    else:
        q = _unscale_pow2(mag, k)
    return tl.minimum(q, QMAX), (bits >> 31) & 1


@triton.jit
def _pack_rows_kernel(
    x_ptr, out_ptr, tail_ptr, dst_ptr, src_ptr, n_rows, stride_x,
    ROW_BYTES: tl.constexpr, TAIL_STRIDE: tl.constexpr, D: tl.constexpr, Q: tl.constexpr,
    BLK: tl.constexpr, NB: tl.constexpr, NB_P: tl.constexpr, TAIL_P: tl.constexpr,
    TAIL_BYTES: tl.constexpr, FP4: tl.constexpr, E4M3S: tl.constexpr, FLOOR: tl.constexpr,
    SCATTER: tl.constexpr, GATHER: tl.constexpr, ROWS: tl.constexpr, SOFT_BF16: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    r64 = r.to(tl.int64)
    if SCATTER:
        d = tl.load(dst_ptr + r64, mask=rmask, other=0).to(tl.int64)
    else:
        d = r64
    if GATHER:  # the rows of x to pack (r64 below: x's row numbers)
        r64 = tl.load(src_ptr + r, mask=rmask, other=0).to(tl.int64)
    blocks = tl.arange(0, NB_P)
    bmask = rmask[:, None] & (blocks < NB)[None, :]
    mask = bmask[:, :, None]
    if FP4:
        WIDTH: tl.constexpr = BLK // 2
        QMAX: tl.constexpr = 6.0
        CODE_BYTES: tl.constexpr = Q // 2
    else:
        WIDTH: tl.constexpr = BLK
        QMAX: tl.constexpr = 448.0
        CODE_BYTES: tl.constexpr = Q
    j = tl.arange(0, WIDTH)
    cols = r64[:, None, None] * stride_x + blocks[None, :, None] * BLK
    x = tl.load(x_ptr + cols + tl.arange(0, BLK)[None, None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = (tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)).to(tl.float32, bitcast=True)
    if FP4:  # even and odd columns apart: they share a byte
        a, b = tl.split(tl.reshape(x, (ROWS, NB_P, WIDTH, 2)))
    else:
        a = x
    if E4M3S:
        ratio = tl.div_rn(tl.maximum(amax, FLOOR), tl.full(amax.shape, 6.0, tl.float32))
        scale_byte = _e4m3_code(tl.minimum(ratio, 448.0))
        scale = _e4m3_value(scale_byte)[:, :, None]
        k = scale_byte[:, :, None]  # not read: the scale divides
    else:
        exponent = _pow2_exponent(amax, FLOOR, QMAX)
        scale_byte = exponent + 127
        k = exponent[:, :, None]
        scale = amax[:, :, None]  # not read: the exponent shifts
    row = out_ptr + d * ROW_BYTES
    qa, sa = _quantised(a, scale, k, E4M3S, QMAX)
    if FP4:
        qb, sb = _quantised(b, scale, k, E4M3S, QMAX)
        code = (_e2m1_code(qa) | (sa << 3)) | ((_e2m1_code(qb) | (sb << 3)) << 4)
        code_ptr = row[:, None, None] + TAIL_BYTES + blocks[None, :, None] * WIDTH
    else:
        code = _e4m3_code(qa) | (sa << 7)
        code_ptr = row[:, None, None] + TAIL_BYTES + blocks[None, :, None] * BLK
    tl.store(code_ptr + j[None, None, :], code.to(tl.uint8), mask=mask)
    scale_ptr = row[:, None] + TAIL_BYTES + CODE_BYTES + blocks[None, :]
    tl.store(scale_ptr, scale_byte.to(tl.uint8), mask=bmask)
    PAD_START: tl.constexpr = TAIL_BYTES + CODE_BYTES + NB
    pad = tl.arange(0, 16)
    pad_mask = rmask[:, None] & (pad < ROW_BYTES - PAD_START)[None, :]
    zeros = tl.zeros((ROWS, 16), dtype=tl.uint8)
    tl.store(row[:, None] + PAD_START + pad[None, :], zeros, mask=pad_mask)
    if TAIL_BYTES > 0:
        t = tl.arange(0, TAIL_P)
        tmask = rmask[:, None] & (t < D - Q)[None, :]
        tail = tl.load(x_ptr + r64[:, None] * stride_x + Q + t[None, :], mask=tmask, other=0.0)
        if SOFT_BF16:
            tail = to_bf16(tail.to(tl.float32), True)
        tail_out = tail_ptr + d[:, None] * TAIL_STRIDE + t[None, :]
        tl.store(tail_out, tail.to(tail_ptr.dtype.element_ty), mask=tmask)


def _supported(x: torch.Tensor, fmt: RowFormat) -> bool:
    """The formats the kernel packs (every one the models use); the rest runs the reference."""
    pow2 = fmt.block & (fmt.block - 1) == 0 and fmt.block >= 4
    e4m3_scaled_fp8 = fmt.code == "e4m3" and fmt.scale == "e4m3"
    return x.dtype in _FLOATS and fmt.tail_dtype in _FLOATS and pow2 and not e4m3_scaled_fp8


def _launch(
    x2: torch.Tensor,
    out: torch.Tensor,
    fmt: RowFormat,
    dst: torch.Tensor | None,
    src: torch.Tensor | None = None,
):
    """Pack rows ``x2`` ``[n, dim]`` into ``out`` ``uint8 [N, row_bytes]``: row ``i`` at
    ``dst[i]`` (``None``: at row ``i``); with ``src`` ``[n]``, row ``src[i]`` of ``x2``."""
    n = x2.shape[0] if src is None else src.shape[0]
    if n == 0:
        return
    fp4, nb = fmt.code == "e2m1", fmt.quantised // fmt.block
    nb_p = triton.next_power_of_2(nb)
    per_row = nb_p * fmt.block
    rows = max(1, min(_TILE_ELEMENTS // per_row, n // _MIN_PROGRAMS))
    rows = 1 << (rows.bit_length() - 1)  # a power of two
    if fmt.code == "e4m3":
        floor = FP8_AMAX_FLOOR
    else:
        floor = FP4_E4M3_AMAX_FLOOR if fmt.scale == "e4m3" else FP4_UE8M0_AMAX_FLOOR
    tail = out.view(fmt.tail_dtype) if fmt.tail_bytes else out
    soft = x2.device.type == "cpu" and fmt.tail_dtype == torch.bfloat16 and x2.dtype != tail.dtype
    _pack_rows_kernel[(triton.cdiv(n, rows),)](
        x2, out, tail, out if dst is None else dst, out if src is None else src, n, x2.stride(0),
        ROW_BYTES=fmt.row_bytes, TAIL_STRIDE=fmt.row_bytes // fmt.tail_dtype.itemsize,
        D=fmt.dim, Q=fmt.quantised, BLK=fmt.block, NB=nb, NB_P=nb_p,
        TAIL_P=triton.next_power_of_2(max(fmt.dim - fmt.quantised, 1)),
        TAIL_BYTES=fmt.tail_bytes, FP4=fp4, E4M3S=fmt.scale == "e4m3", FLOOR=floor,
        SCATTER=dst is not None, GATHER=src is not None, ROWS=rows, SOFT_BF16=soft,
        num_warps=4,
    )  # fmt: skip


@implements("pack_rows")
def pack_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    if x.shape[-1] != fmt.dim:
        raise ValueError(f"x: expected [..., {fmt.dim}] rows for {fmt}, got {tuple(x.shape)}")
    if not _supported(x, fmt):
        return OPS["pack_rows"].reference(x, fmt)
    x2 = x.reshape(-1, fmt.dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], fmt.row_bytes, dtype=torch.uint8, device=x.device)
    _launch(x2, out, fmt, None)
    return out.view(*x.shape[:-1], fmt.row_bytes)


@implements("write_rows")
def write_rows(
    cache: torch.Tensor,
    dst: torch.Tensor,
    values: torch.Tensor,
    fmt: RowFormat,
    src: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather, pack and scatter in one launch (what ``index_copy_`` of :func:`pack_rows`
    stores)."""
    check_write_args(cache, dst, values, fmt, src)
    if not _supported(values, fmt) or not cache.is_contiguous():
        return OPS["write_rows"].reference(cache, dst, values, fmt, src)
    x2 = values if values.stride(-1) == 1 else values.contiguous()
    _launch(x2, cache, fmt, dst.contiguous(), None if src is None else src.contiguous())
    return cache


@triton.jit
def _unpack_rows_kernel(
    src, out, n, stride_src,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr,
    BLK: tl.constexpr, FP4: tl.constexpr, E4M3S: tl.constexpr, TSZ: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (r < n)[:, None] & (cols < D)[None, :]
    like = tl.zeros([1], dtype=out.dtype.element_ty)
    rows = load_packed(src + r[:, None] * stride_src, cols, mask, like, D, Q, BLK, FP4, E4M3S, TSZ)
    tl.store(out + r[:, None] * D + cols[None, :], rows, mask=mask)


@implements("unpack_rows")
def unpack_rows(
    rows: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One launch for any number of rows (the reference takes a dozen torch ops): a
    prefill step's float copies of its cache rows are unpacked by it, once per layer."""
    supported = out_dtype in _FLOATS and (fmt.tail_bytes == 0 or fmt.tail_dtype in TAIL_DTYPES)
    if rows.dtype != torch.uint8 or rows.shape[-1] != fmt.row_bytes or not supported:
        return OPS["unpack_rows"].reference(rows, fmt, out_dtype)  # names bad arguments
    flat = rows.reshape(-1, fmt.row_bytes)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n = flat.shape[0]
    # the interpreter's bf16 / fp16 casts flush subnormals: on a CPU, cast the fp32 values here
    soft = rows.device.type == "cpu" and out_dtype != torch.float32
    out = torch.empty(n, fmt.dim, dtype=torch.float32 if soft else out_dtype, device=rows.device)
    if n:
        block_d = triton.next_power_of_2(fmt.dim)
        per = max(1, min(_TILE_ELEMENTS // block_d, n // _MIN_PROGRAMS))
        per = 1 << (per.bit_length() - 1)
        tail = fmt.tail_dtype.itemsize if fmt.tail_bytes else 0
        _unpack_rows_kernel[(triton.cdiv(n, per),)](
            flat, out, n, flat.stride(0), D=fmt.dim, BLOCK_D=block_d, ROWS=per,
            Q=fmt.quantised, BLK=fmt.block, FP4=int(fmt.code == "e2m1"),
            E4M3S=int(fmt.scale == "e4m3"), TSZ=tail, num_warps=4,
        )  # fmt: skip
    return out.to(out_dtype).view(*rows.shape[:-1], fmt.dim)
