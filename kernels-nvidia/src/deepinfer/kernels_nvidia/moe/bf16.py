"""The ``"bf16"`` family: grouped GEMMs over FP4 (e2m1 + ue8m0) expert weights upcast to bf16
(``MoeTiles.mma="bf16"``), the batch-invariant tiles' kernels and the CPU path.

Rows arrive grouped by expert in ``BLOCK_M`` blocks (``align.align_by_expert``). The packed
weights are dequantised in registers to bf16 (exact: an e2m1 value times a power of two) and
multiplied on the bf16 tensor cores with fp32 accumulation, one block of K at a time; FP8
activations are dequantised the same way. Slower than the chained ``"mx"`` kernels, but every
tile shape gives the same row results whatever the batch, so it serves batch-invariant mode.

- ``gate_up``: ``[rows, D] x [2I, D]^T`` as two accumulators (gate rows ``n``, up rows ``I + n``),
  whose epilogue applies the clamped SwiGLU and the router weight, rounds to bf16 and quantises the
  hidden row to FP8 per group (the reference's input quantisation of ``w2``, fused here).
- ``down``: ``[rows, I] x [D, I]^T``, bf16 out, scattered to the (token, slot) rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.gemm.tiles import e8m0_to_fp32
from deepinfer.kernels_nvidia.quant import pow2_scale, quantize_rows, to_bf16, to_e4m3


@triton.jit
def _e2m1_to_fp32(codes):
    """e2m1 nibble codes (int32, 0..15) -> fp32 values (bit 3 is the sign)."""
    magnitude = codes & 7
    bits = ((magnitude << 22) + (126 << 23)) | ((codes & 8) << 28)  # 2^(e-1) * (1 + m/2)
    value = bits.to(tl.float32, bitcast=True)
    small = magnitude.to(tl.float32) * 0.5  # codes 0, 1: 0 and 0.5 (subnormal in e2m1)
    return tl.where(magnitude < 2, tl.where((codes & 8) != 0, -small, small), value)


@triton.jit
def fp4_weight_tile(
    w_ptr, ws_ptr, rows, k0, stride_wn, stride_wsn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """bf16 ``[BLOCK_N, BLOCK_K]`` of the weight rows ``rows`` (int64), columns ``k0..``."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rows[:, None] * stride_wn + half[None, :])
    packed = packed.to(tl.uint8, bitcast=True).to(tl.int32)
    lo = _e2m1_to_fp32(packed & 15)
    hi = _e2m1_to_fp32(packed >> 4)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = e8m0_to_fp32(tl.load(ws_ptr + rows[:, None] * stride_wsn + groups[None, :]))
    # byte j of the tile holds columns 2j and 2j + 1, both in scale group j // 16
    lo = tl.reshape(
        tl.reshape(lo, (BLOCK_N, BLOCK_K // 32, 16)) * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)
    )
    hi = tl.reshape(
        tl.reshape(hi, (BLOCK_N, BLOCK_K // 32, 16)) * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)
    )
    return tl.interleave(lo.to(tl.bfloat16), hi.to(tl.bfloat16))  # fmt: skip


@triton.jit
def act_tile(
    a_ptr, as_ptr, rows, valid, k0, stride_am, stride_asm,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """bf16 ``[BLOCK_M, BLOCK_K]`` of activation rows ``rows`` (int64; invalid rows read 0)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=valid[:, None], other=0.0)
    if A_FP8:
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        scale = tl.load(
            as_ptr + rows[:, None] * stride_asm + groups[None, :], mask=valid[:, None], other=0.0
        )
        grouped = tl.reshape(a.to(tl.float32), (BLOCK_M, BLOCK_K // GROUP, GROUP))
        a = tl.reshape(grouped * scale[:, :, None], (BLOCK_M, BLOCK_K))
    return a.to(tl.bfloat16)  # fmt: skip


@triton.jit
def _store_hidden(
    h_ptr, hs_ptr, hidden, rows, col0, stride_hm, stride_hsm,
    OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store bf16(hidden) as is, or FP8-quantised per ``OUT_GROUP`` columns with fp32 scales."""
    hidden = to_bf16(hidden, SOFT_ROUND).to(tl.float32)
    cols = col0 + tl.arange(0, BLOCK_N)
    ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    if OUT_GROUP == 0:
        tl.store(ptrs, hidden.to(tl.bfloat16))
    else:
        grouped = tl.reshape(hidden, (BLOCK_M, BLOCK_N // OUT_GROUP, OUT_GROUP))
        scale = pow2_scale(tl.max(tl.abs(grouped), axis=2), 1e-4, 448.0)
        q = to_e4m3(grouped / scale[:, :, None], SOFT_ROUND)
        tl.store(ptrs, tl.reshape(q, (BLOCK_M, BLOCK_N)))
        groups = col0 // OUT_GROUP + tl.arange(0, BLOCK_N // OUT_GROUP)
        tl.store(hs_ptr + rows[:, None] * stride_hsm + groups[None, :], scale)


@triton.jit
def moe_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row_slot_ptr, block_expert_ptr, topk_w_ptr,
    num_slots, top_k, K, inter, limit,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    A_FP8: tl.constexpr, A_GROUP: tl.constexpr, OUT_GROUP: tl.constexpr,
    SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = cols.to(tl.int64)
    up_rows = gate_rows + inter
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = act_tile(x_ptr, xs_ptr, tokens, valid, k0, stride_xm, stride_xsm,
                     A_FP8, A_GROUP, BLOCK_M, BLOCK_K)  # fmt: skip
        w_gate = fp4_weight_tile(w_e, ws_e, gate_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
        acc_gate = tl.dot(a, tl.trans(w_gate), acc_gate)
        w_up = fp4_weight_tile(w_e, ws_e, up_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
        acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    gate = tl.minimum(acc_gate, limit)
    up = tl.clamp(acc_up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    _store_hidden(h_ptr, hs_ptr, hidden, rows, tl.program_id(1) * BLOCK_N, stride_hm, stride_hsm,
                  OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def moe_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr,
    num_slots, K, N,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    A_FP8: tl.constexpr, A_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols.to(tl.int64)
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = act_tile(h_ptr, hs_ptr, rows, valid, k0, stride_hm, stride_hsm,
                     A_FP8, A_GROUP, BLOCK_M, BLOCK_K)  # fmt: skip
        w = fp4_weight_tile(w_e, ws_e, w_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, tl.trans(w), acc)
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(acc, SOFT_ROUND), mask=valid[:, None])


def bf16_experts(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, *, top_k, group, limit,
                 tiles, block_n_gate_up, block_n_down, on_cpu):  # fmt: skip
    """Gate/up then down with this family's kernels: bf16 ``y [T * k, D]``, each row at its
    (token, slot); FP8 activations per ``group`` columns, or bf16 for ``group=None``."""
    tokens, dim = x.shape
    inter = w13.shape[1] // 2
    num_slots = tokens * top_k
    xq, xs = quantised_input(x, group)
    fp8 = group is not None
    capacity, num_blocks = layout.row_slot.numel(), layout.block_expert.numel()
    h = torch.empty(
        (capacity, inter), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=x.device
    )
    hs = torch.empty((capacity, inter // group if fp8 else 1), dtype=torch.float32, device=x.device)
    w13s, w2s = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    n1 = block_n_gate_up
    moe_gate_up_kernel[(num_blocks, inter // n1)](
        xq, xs, w13, w13s, h, hs, layout.row_slot, layout.block_expert, weights,
        num_slots, top_k, dim, inter, limit,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1),
        h.stride(0), hs.stride(0),
        A_FP8=fp8, A_GROUP=group or 1, OUT_GROUP=group or 0, SOFT_ROUND=on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=n1, BLOCK_K=_block_k(dim, group),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    y = torch.empty((num_slots, dim), dtype=torch.bfloat16, device=x.device)
    n2 = block_n_down
    moe_down_kernel[(num_blocks, dim // n2)](
        h, hs, w2, w2s, y, layout.row_slot, layout.block_expert, num_slots, inter, dim,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0),
        A_FP8=fp8, A_GROUP=group or 1, SOFT_ROUND=on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=n2, BLOCK_K=_block_k(inter, group),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def quantised_input(x, group):
    """``(xq, xs)``: e4m3 rows with fp32 scales per ``group`` columns, or bf16 rows and a
    placeholder scale for ``group=None``."""
    if group is None:
        return x.to(torch.bfloat16).contiguous(), x.new_empty((1, 1), dtype=torch.float32)
    return quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), group)


def _block_k(k: int, group: int | None) -> int:
    for block_k in (128, 64, 32):
        if k % block_k == 0 and (group is None or (block_k % group == 0)):
            return block_k
    raise ValueError(
        f"K={k} with act_quant_group={group}: expected K a multiple of 32 and of the group"
    )
