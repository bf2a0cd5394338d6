"""Gathering K=V rows for the sparse attention and indexer kernels: from up to three sources in
place, each a float tensor or cache rows in the model's formats (:class:`PackedRows`).

The engine hands attention its window rings, this step's tokens and the compressed arena as
separate tensors; an index ``r`` names row ``r`` of their virtual concatenation. Each tile of
indices is loaded with one masked load per source (lanes of other sources issue no memory
traffic) and merged with selects, so no source is ever copied and nothing syncs with the host.

A packed source is read as bytes and decoded in registers (:func:`load_packed`): e4m3 / e2m1
codes and ue8m0 / e4m3 scales by integer arithmetic, the tail from its bf16 / fp32 bytes; the
value ``code * scale`` is exact in fp32, so the rows equal the reference's dequantised ones.
A format is described to the kernel by compile-time numbers per source (``Q``: quantised
columns, 0 for a float source; ``BLK``; ``FP4``; ``E4M3S``: e4m3 scales; ``TSZ``: tail bytes
per value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import PackedRows
from deepinfer.kernels.reference.attention import kv_sources


@triton.jit
def _e4m3_to_f32(b):
    """e4m3fn byte values (int32 0..255) -> fp32 (no NaN codes are ever stored)."""
    sign = (b >> 7) & 1
    exp = (b >> 3) & 15
    man = b & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # 2^-9
    sub = (sub.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)  # -0 too
    return tl.where(exp == 0, sub, normal)


@triton.jit
def _e2m1_to_f32(n):
    """e2m1 nibbles (int32 0..15) -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    m = n & 7
    e = m >> 1
    half = (m & 1).to(tl.float32) * 0.5
    normal = ((2 + (m & 1)) << tl.maximum(e - 1, 0)).to(tl.float32) * 0.5
    value = tl.where(e == 0, half, normal)
    # the sign bit set, not negated: Triton's negation is 0 - x, which turns -0 into +0
    return (value.to(tl.int32, bitcast=True) | ((n & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def load_packed(
    rowp, cols, mask, like,
    D: tl.constexpr, Q: tl.constexpr, BLK: tl.constexpr, FP4: tl.constexpr,
    E4M3S: tl.constexpr, TSZ: tl.constexpr,
):  # fmt: skip
    """The rows of packed bytes starting at ``rowp`` ``[N, 1]`` (uint8 pointers) at columns
    ``cols``, ``mask`` ``[N, C]``; the layout of :mod:`deepinfer.kernels.formats`."""
    code_off = (D - Q) * TSZ
    if FP4:
        scale_off = code_off + Q // 2
    else:
        scale_off = code_off + Q
    quantised = cols < Q
    qmask = mask & quantised[None, :]
    if FP4:
        byte = tl.load(rowp + code_off + cols[None, :] // 2, mask=qmask, other=0).to(tl.int32)
        values = _e2m1_to_f32((byte >> ((cols[None, :] & 1) * 4)) & 15)
    else:
        byte = tl.load(rowp + code_off + cols[None, :], mask=qmask, other=0).to(tl.int32)
        values = _e4m3_to_f32(byte)
    sbyte = tl.load(rowp + scale_off + cols[None, :] // BLK, mask=qmask, other=0).to(tl.int32)
    if E4M3S:
        scale = _e4m3_to_f32(sbyte)
    else:
        scale = (sbyte << 23).to(tl.float32, bitcast=True)
    rows = values * scale
    if TSZ > 0:
        tmask = mask & (cols >= Q)[None, :]
        tail = rowp + (cols[None, :] - Q) * TSZ
        bits = tl.load(tail, mask=tmask, other=0).to(tl.int32)
        bits |= tl.load(tail + 1, mask=tmask, other=0).to(tl.int32) << 8
        if TSZ == 4:
            bits |= tl.load(tail + 2, mask=tmask, other=0).to(tl.int32) << 16
            bits |= tl.load(tail + 3, mask=tmask, other=0).to(tl.int32) << 24
        else:
            bits = bits << 16
        rows = tl.where(quantised[None, :], rows, bits.to(tl.float32, bitcast=True))
    return rows.to(like.dtype)


@triton.jit
def load_source(
    ptr, stride, r, cols, mask, like,
    D: tl.constexpr, Q: tl.constexpr, BLK: tl.constexpr, FP4: tl.constexpr,
    E4M3S: tl.constexpr, TSZ: tl.constexpr,
):  # fmt: skip
    """Rows ``r`` ``[N]`` (int64) of one source (row stride ``stride`` elements)."""
    return load_at(ptr + r[:, None] * stride, cols, mask, like, D, Q, BLK, FP4, E4M3S, TSZ)


@triton.jit
def load_at(
    rowp, cols, mask, like,
    D: tl.constexpr, Q: tl.constexpr, BLK: tl.constexpr, FP4: tl.constexpr,
    E4M3S: tl.constexpr, TSZ: tl.constexpr,
):  # fmt: skip
    """The rows starting at ``rowp`` ``[N, 1]``, a float source's or packed bytes. (An
    if / else, not an early return: the code after a compile-time return is still traced, and
    packed decoding does not type-check through a float8 pointer.)"""
    if Q == 0:
        rows = tl.load(rowp + cols[None, :], mask=mask, other=0.0).to(like.dtype)
    else:
        rows = load_packed(rowp, cols, mask, like, D, Q, BLK, FP4, E4M3S, TSZ)
    return rows


@triton.jit
def load_rows(
    kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
    idx, cols, col_mask, like, NUM_SRC: tl.constexpr, D: tl.constexpr,
    Q0: tl.constexpr, BLK0: tl.constexpr, FP40: tl.constexpr, E4M3S0: tl.constexpr,
    TSZ0: tl.constexpr, Q1: tl.constexpr, BLK1: tl.constexpr, FP41: tl.constexpr,
    E4M3S1: tl.constexpr, TSZ1: tl.constexpr, Q2: tl.constexpr, BLK2: tl.constexpr,
    FP42: tl.constexpr, E4M3S2: tl.constexpr, TSZ2: tl.constexpr, UNIFORM: tl.constexpr,
):  # fmt: skip
    """Rows ``idx`` ``[N]`` (``-1``: zeros) at columns ``cols`` of the sources, as ``like``'s
    dtype: source 0 holds rows ``[0, end0)``, source 1 ``[end0, end1)``, source 2 the rest.
    ``UNIFORM``: every source has one dtype and format, so the rows load through per-row
    pointers in one load (separate loads each take their own pipelining buffers)."""
    r = idx.to(tl.int64)
    valid = idx >= 0
    if UNIFORM:
        rowp = kv0 + r * stride0
        if NUM_SRC > 1:
            rowp = tl.where(r >= end0, kv1 + (r - end0) * stride1, rowp)
        if NUM_SRC > 2:
            rowp = tl.where(r >= end1, kv2 + (r - end1) * stride2, rowp)
        rows = load_at(rowp[:, None], cols, valid[:, None] & col_mask[None, :], like,
                       D, Q0, BLK0, FP40, E4M3S0, TSZ0)  # fmt: skip
    else:
        rows = load_mixed(kv0, kv1, kv2, stride0, stride1, stride2, end0, end1, r, valid,
                          cols, col_mask, like, NUM_SRC, D, Q0, BLK0, FP40, E4M3S0, TSZ0, Q1,
                          BLK1, FP41, E4M3S1, TSZ1, Q2, BLK2, FP42, E4M3S2, TSZ2)  # fmt: skip
    return rows


@triton.jit
def load_mixed(
    kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
    r, valid, cols, col_mask, like, NUM_SRC: tl.constexpr, D: tl.constexpr,
    Q0: tl.constexpr, BLK0: tl.constexpr, FP40: tl.constexpr, E4M3S0: tl.constexpr,
    TSZ0: tl.constexpr, Q1: tl.constexpr, BLK1: tl.constexpr, FP41: tl.constexpr,
    E4M3S1: tl.constexpr, TSZ1: tl.constexpr, Q2: tl.constexpr, BLK2: tl.constexpr,
    FP42: tl.constexpr, E4M3S2: tl.constexpr, TSZ2: tl.constexpr,
):  # fmt: skip
    """Sources of different dtypes or formats: one masked load per source (lanes of other
    sources issue no memory traffic), merged with selects."""
    in0 = valid & (r < end0) if NUM_SRC > 1 else valid
    rows = load_source(kv0, stride0, r, cols, in0[:, None] & col_mask[None, :], like,
                        D, Q0, BLK0, FP40, E4M3S0, TSZ0)  # fmt: skip
    if NUM_SRC > 1:
        in1 = (r >= end0) & (r < end1) if NUM_SRC > 2 else r >= end0
        rows1 = load_source(kv1, stride1, r - end0, cols, in1[:, None] & col_mask[None, :],
                             like, D, Q1, BLK1, FP41, E4M3S1, TSZ1)  # fmt: skip
        rows = tl.where(in1[:, None], rows1, rows)
    if NUM_SRC > 2:
        in2 = r >= end1
        rows2 = load_source(kv2, stride2, r - end1, cols, in2[:, None] & col_mask[None, :],
                             like, D, Q2, BLK2, FP42, E4M3S2, TSZ2)  # fmt: skip
        rows = tl.where(in2[:, None], rows2, rows)
    return rows


TAIL_DTYPES = (torch.bfloat16, torch.float32)


def format_consts(source, index: int | str) -> dict[str, int]:
    """The compile-time description of one source (``Q`` 0: a float tensor), keyed with the
    source's ``index`` suffix."""
    if not isinstance(source, PackedRows):
        return {f"Q{index}": 0, f"BLK{index}": 1, f"FP4{index}": 0, f"E4M3S{index}": 0,
                f"TSZ{index}": 0}  # fmt: skip
    f = source.fmt
    if f.quantised < f.dim and f.tail_dtype not in TAIL_DTYPES:
        raise ValueError(f"packed rows: a {f.tail_dtype} tail is not supported (bf16 or fp32)")
    tail = f.tail_dtype.itemsize if f.quantised < f.dim else 0
    return {f"Q{index}": f.quantised, f"BLK{index}": f.block, f"FP4{index}": int(f.code == "e2m1"),
            f"E4M3S{index}": int(f.scale == "e4m3"), f"TSZ{index}": tail}  # fmt: skip


def source_args(kv) -> tuple[tuple, dict[str, int], tuple]:
    """(``kv0, kv1, kv2, stride0, stride1, stride2, end0, end1`` launch arguments, the
    compile-time ones (``NUM_SRC``, ``D`` and each source's format), the sources) of a tensor,
    :class:`PackedRows` or a sequence of them; float sources get unit-stride rows."""
    sources = tuple(
        s if isinstance(s, PackedRows) or s.stride(-1) == 1 else s.contiguous()
        for s in kv_sources(kv)
    )
    data = tuple(s.data if isinstance(s, PackedRows) else s for s in sources)
    padded = data + (data[0],) * (3 - len(data))
    ends = [sum(s.shape[0] for s in sources[: i + 1]) for i in range(2)]
    strides = [s.stride(0) if i < len(data) else 0 for i, s in enumerate(padded)]
    consts = {"NUM_SRC": len(sources), "D": sources[0].shape[1], "UNIFORM": int(uniform(sources))}
    for i in range(3):
        consts |= format_consts(sources[i] if i < len(sources) else data[0], i)
    return (*padded, *strides, *ends), consts, sources


def uniform(sources) -> bool:
    """Whether every source has one dtype and format (read through one load)."""

    def kind(s):
        return s.fmt if isinstance(s, PackedRows) else s.dtype

    return all(kind(s) == kind(sources[0]) for s in sources[1:])


def stages_for(consts: dict[str, int], num_stages: int) -> int:
    """Software-pipelining stages for a launch: ``num_stages`` when every row comes from one
    float load; one when sources of different formats each take their own loads, or packed
    rows take several byte loads (each load's pipelining buffers would overflow the H200's
    227 KB of shared memory at the model's shapes)."""
    return num_stages if consts["UNIFORM"] and consts["Q0"] == 0 else 1


def is_float32(sources) -> bool:
    return any(isinstance(s, torch.Tensor) and s.dtype == torch.float32 for s in sources)
