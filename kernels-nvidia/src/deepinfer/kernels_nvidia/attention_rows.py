"""Gathering K=V rows for the sparse attention kernels from up to three sources in place.

The engine hands attention its window rings, this step's tokens and the compressed arena as
separate tensors; an index ``r`` names row ``r`` of their virtual concatenation. Each tile of
indices is loaded through per-row pointers into the source that holds the row (one load when
the sources share a dtype; else one masked load per source, merged with selects), so no source
is ever copied and nothing syncs with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference.attention import kv_sources


@triton.jit
def load_rows(
    kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
    idx, cols, col_mask, like, NUM_SRC: tl.constexpr,
):  # fmt: skip
    """Rows ``idx`` ``[N]`` (``-1``: zeros) at columns ``cols`` of the sources, as ``like``'s
    dtype: source 0 holds rows ``[0, end0)``, source 1 ``[end0, end1)``, source 2 the rest."""
    r = idx.to(tl.int64)
    valid = idx >= 0
    if NUM_SRC == 1 or (kv0.dtype == kv1.dtype and kv1.dtype == kv2.dtype):
        # one load through per-row pointers: separate loads would each take their own
        # pipelining buffers in shared memory
        ptrs = kv0 + r * stride0
        if NUM_SRC > 1:
            ptrs = tl.where(r >= end0, kv1 + (r - end0) * stride1, ptrs)
        if NUM_SRC > 2:
            ptrs = tl.where(r >= end1, kv2 + (r - end1) * stride2, ptrs)
        rows = tl.load(
            ptrs[:, None] + cols[None, :], mask=valid[:, None] & col_mask[None, :], other=0.0
        ).to(like.dtype)
        return rows
    in0 = valid & (r < end0)
    rows = tl.load(
        kv0 + r[:, None] * stride0 + cols[None, :], mask=in0[:, None] & col_mask[None, :],
        other=0.0,
    ).to(like.dtype)  # fmt: skip
    in1 = (r >= end0) & (r < end1) if NUM_SRC > 2 else r >= end0
    rows1 = tl.load(
        kv1 + (r - end0)[:, None] * stride1 + cols[None, :],
        mask=in1[:, None] & col_mask[None, :], other=0.0,
    ).to(like.dtype)  # fmt: skip
    rows = tl.where(in1[:, None], rows1, rows)
    if NUM_SRC > 2:
        in2 = r >= end1
        rows2 = tl.load(
            kv2 + (r - end1)[:, None] * stride2 + cols[None, :],
            mask=in2[:, None] & col_mask[None, :], other=0.0,
        ).to(like.dtype)  # fmt: skip
        rows = tl.where(in2[:, None], rows2, rows)
    return rows


def source_args(kv) -> tuple[tuple, int, tuple[torch.Tensor, ...]]:
    """(``kv0, kv1, kv2, stride0, stride1, stride2, end0, end1`` launch arguments, the number of
    sources, the sources with unit-stride rows) of a tensor or a sequence of sources."""
    sources = tuple(s if s.stride(-1) == 1 else s.contiguous() for s in kv_sources(kv))
    padded = sources + (sources[0],) * (3 - len(sources))
    ends = [sum(s.shape[0] for s in sources[: i + 1]) for i in range(2)]
    strides = [s.stride(0) if i < len(sources) else 0 for i, s in enumerate(padded)]
    return (*padded, *strides, *ends), len(sources), sources


def is_float32(sources: tuple[torch.Tensor, ...]) -> bool:
    return any(s.dtype == torch.float32 for s in sources)
