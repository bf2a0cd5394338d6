"""Sparse multi-query attention with a per-head sink over per-row index lists, in Triton.

Every query head of a row attends the same gathered K=V rows, so one program takes a block of
``HB`` heads of one row as the ``M`` side of the two matrix products (``q kv^T`` and ``p kv``)
and streams the row's index list in tiles of ``BLOCK_N`` gathered rows (online softmax, fp32
accumulators, ``exp2`` with ``log2 e`` folded into the scale).

Two launch shapes, one kernel:

- split: the index list is cut into splits of a fixed number of entries (``split_size``), one
  program per (row, head block, split), each writing an unnormalised fp32 partial; a second
  kernel merges a row's splits in split order and adds the sink. With
  ``DEEPINFER_BATCH_INVARIANT=1`` this path serves every launch with one split size, so nothing
  depends on the number of rows and a row's output is bitwise identical for every batch size.
  Otherwise it serves only tiny batches (``SPLIT_ROWS_MAX`` rows), where it is the only way to
  fill the GPU (the partials of 64 heads x 512 dims in fp32 outweigh the FP8 rows they
  summarise), with splits as short as it takes to give about ``SPLIT_PROGRAMS`` programs:
  a decode row's list is only 128-640 entries, so at batch 1 the fixed size left 1-5 programs.
- whole list: one program per (row, head block) walks the whole list and finishes in place.

Default tiles are the fastest measured on an H200 (``benchmarks/kernels/bench_attention.py``):
64 heads per program (one gather serves every head), 32-row tiles for splits; whole lists run
the two-halves kernel of :mod:`.attention_prefill` with 64-row tiles and two stages.

KV may be stored in bf16/fp16/fp32 like ``q``, or in ``float8_e4m3fn`` (the cache format),
upcast in registers to ``q``'s dtype: half the bytes gathered. It may be one tensor or up to
three sources read in place (:mod:`.attention_rows`), each of its own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepinfer.kernels import PackedRows, envs
from deepinfer.kernels_nvidia.attention_prefill import launch_halves
from deepinfer.kernels_nvidia.attention_rows import is_float32, load_rows, source_args, stages_for
from deepinfer.kernels_nvidia.registry import implements

LOG2E = 1.4426950408889634


SPLIT_ROWS_MAX = 32  # rows up to which the split path runs when batch invariance is off
SPLIT_PROGRAMS = 128  # programs the split size aims at when batch invariance is off
MIN_SPLIT = 16  # the shortest split (one 16-row tile)


@dataclass(frozen=True)
class AttentionTiles:
    """Launch parameters: heads per program, gathered rows per tile, entries per split, the
    number of rows up to which the split path runs (``None``: the default policy), and whether
    whole-list launches use the two-halves kernel of :mod:`.attention_prefill`."""

    head_block: int = 64
    block_n: int = 32
    split_size: int = 128
    num_warps: int = 8
    num_stages: int = 2
    split_rows_max: int | None = None
    halves: bool = False


SPLIT_TILES = AttentionTiles()
# The two-halves kernel beat the one-piece kernel (64-row tiles, 3 stages) on prefill rows.
WHOLE_LIST_TILES = AttentionTiles(block_n=64, num_stages=2, halves=True)
# fp32 operands take twice the shared memory per tile and run the exact (FMA) dot path.
FP32_TILES = AttentionTiles(head_block=16, block_n=16, num_warps=4)


def choose_tiles(rows: int, dtype: torch.dtype, *, batch_invariant: bool, entries: int = 0):
    """(tiles, is_split) for ``rows`` query rows of ``dtype`` over lists of ``entries``
    indices. Batch-invariant launches keep ``SPLIT_TILES``' fixed split size."""
    is_split = batch_invariant or rows <= SPLIT_ROWS_MAX
    if dtype == torch.float32:
        return FP32_TILES, is_split
    if not is_split:
        return WHOLE_LIST_TILES, False
    if batch_invariant:
        return SPLIT_TILES, True
    wanted = triton.next_power_of_2(max(1, rows * entries // SPLIT_PROGRAMS))
    split = max(MIN_SPLIT, min(SPLIT_TILES.split_size, wanted))
    block_n = min(SPLIT_TILES.block_n, split)
    return replace(SPLIT_TILES, split_size=split, block_n=block_n), True


@triton.jit
def _sparse_mqa_kernel(
    q_ptr, kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
    idx_ptr, sink_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    num_heads, head_dim, num_idx, num_splits, split_len,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
    scale_log2,
    HB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, IEEE: tl.constexpr,
    NUM_SRC: tl.constexpr, D: tl.constexpr,
    Q0: tl.constexpr, BLK0: tl.constexpr, FP40: tl.constexpr, E4M3S0: tl.constexpr,
    TSZ0: tl.constexpr, Q1: tl.constexpr, BLK1: tl.constexpr, FP41: tl.constexpr,
    E4M3S1: tl.constexpr, TSZ1: tl.constexpr, Q2: tl.constexpr, BLK2: tl.constexpr,
    FP42: tl.constexpr, E4M3S2: tl.constexpr, TSZ2: tl.constexpr, UNIFORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    heads = pid_h * HB + tl.arange(0, HB)
    head_mask = heads < num_heads
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < head_dim
    q_offs = row * stride_qt + heads[:, None] * stride_qh + dcols[None, :]
    q = tl.load(q_ptr + q_offs, mask=head_mask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, BLOCK_D], tl.float32)
    start = pid_s * split_len
    end = tl.minimum(start + split_len, num_idx)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + row * stride_it + offs, mask=offs < end, other=-1)
        valid = idx >= 0
        kv = load_rows(kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
                       idx, dcols, dmask, q, NUM_SRC, D, Q0, BLK0, FP40, E4M3S0, TSZ0, Q1, BLK1, FP41, E4M3S1, TSZ1,
                       Q2, BLK2, FP42, E4M3S2, TSZ2, UNIFORM)  # fmt: skip
        if IEEE:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if IS_SPLIT:
        part = (row * num_splits + pid_s) * num_heads + heads  # [HB] partial slots
        tl.store(
            part_acc_ptr + part.to(tl.int64)[:, None] * BLOCK_D + dcols[None, :],
            acc,
            mask=head_mask[:, None],
        )
        tl.store(part_ml_ptr + 2 * part, m_i, mask=head_mask)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=head_mask)
    else:
        sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        corr = tl.exp2(m_i - m_fin)
        denom = l_i * corr + tl.exp2(sink - m_fin)
        out = acc * (corr / denom)[:, None]
        o_offs = row * stride_ot + heads[:, None] * stride_oh + dcols[None, :]
        tl.store(
            out_ptr + o_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dmask[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr,
    num_heads, head_dim, num_splits, stride_ot, stride_oh,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (row, head): merge the splits in split order, add the sink."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dcols = tl.arange(0, BLOCK_D)
    sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
    base = row * num_splits * num_heads + head
    m_all = sink
    for s in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + 2 * (base + s * num_heads)))
    denom = tl.exp2(sink - m_all)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(num_splits):
        slot = base + s * num_heads
        m_s = tl.load(part_ml_ptr + 2 * slot)
        w = tl.exp2(m_s - m_all)  # m_s = -inf (empty split) gives 0
        denom += tl.load(part_ml_ptr + 2 * slot + 1) * w
        acc += tl.load(part_acc_ptr + slot * BLOCK_D + dcols) * w
    out = acc / denom
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + dcols,
        out.to(out_ptr.dtype.element_ty),
        mask=dcols < head_dim,
    )


def _check_inputs(q, kv, indices, sink):
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q: expected fp32/bf16/fp16, got {q.dtype}")
    single = isinstance(kv, (torch.Tensor, PackedRows))
    for i, s in enumerate((kv,) if single else tuple(kv)):
        name = "kv" if single else f"kv[{i}]"
        if not isinstance(s, (torch.Tensor, PackedRows)) or s.dim() != 2 or s.shape[1] != d:
            raise ValueError(f"{name}: expected [M, {d}], got {getattr(s, 'shape', s)}")
    if indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices: expected [{t}, K], got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices: expected int32/int64, got {indices.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink: expected shape ({h},), got {tuple(sink.shape)}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@implements("sparse_mqa_sink")
def sparse_mqa_sink(q, kv, indices, sink, scale, *, tiles: AttentionTiles | None = None):
    """See :func:`deepinfer.kernels.sparse_mqa_sink`. ``kv`` (or each source) may also be
    ``float8_e4m3fn`` (or any float dtype: the products run in fp32 when ``q`` or a source is
    fp32, as the reference's do, else in ``q``'s dtype)."""
    _check_inputs(q, kv, indices, sink)
    kv_args, consts, sources = source_args(kv)
    out_dtype = q.dtype
    if is_float32(sources) or q.dtype not in (torch.bfloat16, torch.float16):
        q = q.float()
    if tiles is None or tiles.split_rows_max is None:
        auto, is_split = choose_tiles(
            q.shape[0], q.dtype, batch_invariant=envs.batch_invariant(), entries=indices.shape[1]
        )
        tiles = tiles or auto
    else:
        is_split = q.shape[0] <= tiles.split_rows_max
    q, indices = _unit_last(q), _unit_last(indices)
    sink = sink.float().contiguous()
    t, h, d = q.shape
    num_idx = indices.shape[1]
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out.to(out_dtype)
    block_d = max(16, triton.next_power_of_2(d))
    hb = max(16, min(tiles.head_block, triton.next_power_of_2(h)))
    split = tiles.split_size if is_split else max(tiles.block_n, num_idx)
    num_splits = max(1, triton.cdiv(num_idx, split))
    if is_split:
        part_acc = torch.empty(t, num_splits, h, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, num_splits, h, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    if not is_split and tiles.halves and q.dtype != torch.float32 and block_d == d and d >= 32:
        launch_halves(
            q, kv_args, consts, indices, sink, out, float(scale) * LOG2E, head_block=hb,
            block_n=tiles.block_n, num_warps=tiles.num_warps,
            num_stages=stages_for(consts, tiles.num_stages),
        )  # fmt: skip
        return out.to(out_dtype)
    grid = (t, triton.cdiv(h, hb), num_splits)
    _sparse_mqa_kernel[grid](
        q, *kv_args, indices, sink, out, part_acc, part_ml,
        h, d, num_idx, num_splits, split,
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E,
        HB=hb, BLOCK_D=block_d, BLOCK_N=tiles.block_n, IS_SPLIT=is_split,
        IEEE=q.dtype == torch.float32, **consts,
        num_warps=tiles.num_warps, num_stages=stages_for(consts, tiles.num_stages),
    )  # fmt: skip
    if is_split:
        _merge_splits_kernel[(t, h)](
            part_acc, part_ml, sink, out, h, d, num_splits, out.stride(0), out.stride(1),
            BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out.to(out_dtype)
