"""Whole-list sparse MQA with sink for many query rows (prefill), the head dim in two halves.

One program per (row, block of heads) walks the row's whole index list in tiles of ``BLOCK_N``
gathered rows, as the whole-list path of :mod:`.attention` does, but keeps the queries, the
gathered tile and the output accumulator as two ``D/2``-wide halves: ``q kv^T`` is the sum of
two half products and ``p kv`` updates two ``[heads, D/2]`` accumulators. Smaller operands per
product and accumulator give the compiler room to pipeline the gathers (``num_stages``), and the
next tile's indices are loaded before the current tile's products, off the critical path.
Online softmax in the exp2 domain, fp32 accumulators, the sink added at the end.
(Rescaling the accumulators only when a head's max grew by more than 2^8 measured slower on
the H200.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels_nvidia.attention_rows import load_rows


@triton.jit
def _sparse_mqa_halves_kernel(
    q_ptr, kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
    idx_ptr, sink_ptr, out_ptr,
    num_heads, num_idx, stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
    scale_log2,
    HB: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SRC: tl.constexpr, D: tl.constexpr,
    Q0: tl.constexpr, BLK0: tl.constexpr, FP40: tl.constexpr, E4M3S0: tl.constexpr,
    TSZ0: tl.constexpr, Q1: tl.constexpr, BLK1: tl.constexpr, FP41: tl.constexpr,
    E4M3S1: tl.constexpr, TSZ1: tl.constexpr, Q2: tl.constexpr, BLK2: tl.constexpr,
    FP42: tl.constexpr, E4M3S2: tl.constexpr, TSZ2: tl.constexpr, UNIFORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    head_mask = heads < num_heads
    d = tl.arange(0, HALF)
    q_offs = row * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_ptr + q_offs, mask=head_mask[:, None], other=0.0)
    q_hi = tl.load(q_ptr + q_offs + HALF, mask=head_mask[:, None], other=0.0)

    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc_lo = tl.zeros([HB, HALF], tl.float32)
    acc_hi = tl.zeros([HB, HALF], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    idx = tl.load(idx_ptr + row * stride_it + offs, mask=offs < num_idx, other=-1)
    every = d < HALF
    for n0 in range(0, num_idx, BLOCK_N):
        valid = idx >= 0
        kv_lo = load_rows(kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
                          idx, d, every, q_lo, NUM_SRC, D, Q0, BLK0, FP40, E4M3S0, TSZ0, Q1, BLK1, FP41, E4M3S1, TSZ1,
                       Q2, BLK2, FP42, E4M3S2, TSZ2, UNIFORM)  # fmt: skip
        kv_hi = load_rows(kv0, kv1, kv2, stride0, stride1, stride2, end0, end1,
                          idx, d + HALF, every, q_lo, NUM_SRC, D, Q0, BLK0, FP40, E4M3S0, TSZ0, Q1, BLK1, FP41, E4M3S1, TSZ1,
                       Q2, BLK2, FP42, E4M3S2, TSZ2, UNIFORM)  # fmt: skip
        nxt = n0 + BLOCK_N + offs
        idx = tl.load(idx_ptr + row * stride_it + nxt, mask=nxt < num_idx, other=-1)
        s = tl.dot(q_lo, tl.trans(kv_lo))
        s = tl.dot(q_hi, tl.trans(kv_hi), s)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(kv_lo.dtype)
        acc_lo = tl.dot(p, kv_lo, acc_lo * alpha[:, None])
        acc_hi = tl.dot(p, kv_hi, acc_hi * alpha[:, None])
        m_i = m_new

    sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    corr = tl.exp2(m_i - m_fin)
    norm = corr / (l_i * corr + tl.exp2(sink - m_fin))
    o_offs = row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_offs, (acc_lo * norm[:, None]).to(dtype), mask=head_mask[:, None])
    tl.store(out_ptr + o_offs + HALF, (acc_hi * norm[:, None]).to(dtype), mask=head_mask[:, None])


def launch_halves(q, kv_args, consts, indices, sink, out, scale_log2, *, head_block, block_n,
                  num_warps, num_stages):  # fmt: skip
    """Launch over ``[T, H, D]`` bf16/fp16 ``q`` (``D`` a power of two >= 32), unit-stride
    last dims, the KV sources as :func:`.attention_rows.source_args` gives them; ``out`` like
    ``q``."""
    t, h, d = q.shape
    grid = (t, triton.cdiv(h, head_block))
    _sparse_mqa_halves_kernel[grid](
        q, *kv_args, indices, sink, out, h, indices.shape[1],
        q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1),
        scale_log2, HB=head_block, HALF=d // 2, BLOCK_N=block_n, **consts,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
