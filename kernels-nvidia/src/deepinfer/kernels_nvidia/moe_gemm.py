"""Grouped GEMMs over FP4 (e2m1 + ue8m0) expert weights for the routed experts, in Triton.

Rows arrive grouped by expert in blocks of ``BLOCK_M`` (see ``moe_experts.align_by_expert``):
``block_expert[b]`` names block ``b``'s expert (-1: unused block) and ``row_slot[r]`` the flat
(token, slot) index ``t * k + j`` of row ``r`` (``num_slots``: padding). The packed weights are
dequantised in registers to bf16 (exact: an e2m1 value times a power of two) and multiplied on
the bf16 tensor cores with fp32 accumulation; FP8 activations are dequantised the same way.

- ``gate_up``: ``[rows, D] x [2I, D]^T`` as two accumulators (gate rows ``n``, up rows ``I + n``),
  whose epilogue applies the clamped SwiGLU and the router weight, rounds to bf16 and quantises the
  hidden row to FP8 per group (the reference's input quantisation of ``w2``, fused here).
- ``down``: ``[rows, I] x [D, I]^T``, bf16 out, scattered to the (token, slot) rows.

``PAIRS`` (opt-in, not yet measured on the GPU): instead of interleaving the two nibbles of each
weight byte in registers, the activations are stored with each 32-column chunk's even columns
first and odd columns second, so a byte's low and high nibbles meet their activations in two
16-wide dots, and each 32-column step has a single weight scale per row (no register reshapes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels_nvidia.gemm import e8m0_to_fp32
from deepinfer.kernels_nvidia.quant import pow2_scale, to_bf16, to_e4m3


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
def fp4_pair_tile(w_ptr, ws_ptr, rows, k0, stride_wn, stride_wsn, BLOCK_N: tl.constexpr):
    """Columns ``k0..k0+31`` (one scale group) of the weight rows ``rows`` as two bf16
    ``[BLOCK_N, 16]`` tiles: the even columns (low nibbles) and the odd ones (high nibbles).
    No register shuffles: the activation is permuted to match instead (``PAIRS`` layout)."""
    half = k0 // 2 + tl.arange(0, 16)
    packed = tl.load(w_ptr + rows[:, None] * stride_wn + half[None, :])
    packed = packed.to(tl.uint8, bitcast=True).to(tl.int32)
    scale = e8m0_to_fp32(tl.load(ws_ptr + rows * stride_wsn + k0 // 32))[:, None]
    even = (_e2m1_to_fp32(packed & 15) * scale).to(tl.bfloat16)
    odd = (_e2m1_to_fp32(packed >> 4) * scale).to(tl.bfloat16)
    return even, odd


@triton.jit
def act_pair(
    a_ptr, as_ptr, rows, valid, k0, stride_am, stride_asm,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """bf16 ``[BLOCK_M, 16]`` even / odd columns of ``k0..k0+31`` from an activation stored in
    the ``PAIRS`` layout (each 32-column chunk holds its 16 even columns, then its 16 odd)."""
    base = a_ptr + rows[:, None] * stride_am + (k0 + tl.arange(0, 16))[None, :]
    even = tl.load(base, mask=valid[:, None], other=0.0)
    odd = tl.load(base + 16, mask=valid[:, None], other=0.0)
    if A_FP8:
        scale = tl.load(as_ptr + rows * stride_asm + k0 // GROUP, mask=valid, other=0.0)[:, None]
        even = even.to(tl.float32) * scale
        odd = odd.to(tl.float32) * scale
    return even.to(tl.bfloat16), odd.to(tl.bfloat16)


@triton.jit
def pairs_position(cols):
    """Column ``c`` -> its place in the ``PAIRS`` layout (evens then odds per 32 columns)."""
    return (cols & -32) + (cols & 1) * 16 + ((cols & 31) >> 1)


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
    PAIRS: tl.constexpr,
):  # fmt: skip
    """Store bf16(hidden) as is, or FP8-quantised per ``OUT_GROUP`` columns with fp32 scales;
    ``PAIRS``: columns in the pairs layout that the down projection reads."""
    hidden = to_bf16(hidden, SOFT_ROUND).to(tl.float32)
    cols = col0 + tl.arange(0, BLOCK_N)
    if PAIRS:
        cols = pairs_position(cols)
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
    PAIRS: tl.constexpr,
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
        if PAIRS:
            for kk in tl.static_range(BLOCK_K // 32):
                kc = k0 + kk * 32
                a_even, a_odd = act_pair(x_ptr, xs_ptr, tokens, valid, kc, stride_xm, stride_xsm,
                                         A_FP8, A_GROUP, BLOCK_M)  # fmt: skip
                g_even, g_odd = fp4_pair_tile(
                    w_e, ws_e, gate_rows, kc, stride_wn, stride_wsn, BLOCK_N
                )
                acc_gate = tl.dot(a_even, tl.trans(g_even), acc_gate)
                acc_gate = tl.dot(a_odd, tl.trans(g_odd), acc_gate)
                u_even, u_odd = fp4_pair_tile(
                    w_e, ws_e, up_rows, kc, stride_wn, stride_wsn, BLOCK_N
                )
                acc_up = tl.dot(a_even, tl.trans(u_even), acc_up)
                acc_up = tl.dot(a_odd, tl.trans(u_odd), acc_up)
        else:
            a = act_tile(x_ptr, xs_ptr, tokens, valid, k0, stride_xm, stride_xsm,
                         A_FP8, A_GROUP, BLOCK_M, BLOCK_K)  # fmt: skip
            w_gate = fp4_weight_tile(
                w_e, ws_e, gate_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K
            )
            acc_gate = tl.dot(a, tl.trans(w_gate), acc_gate)
            w_up = fp4_weight_tile(w_e, ws_e, up_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    gate = tl.minimum(acc_gate, limit)
    up = tl.clamp(acc_up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    _store_hidden(h_ptr, hs_ptr, hidden, rows, tl.program_id(1) * BLOCK_N, stride_hm, stride_hsm,
                  OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N, PAIRS)  # fmt: skip


@triton.jit
def moe_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr,
    num_slots, K, N,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    A_FP8: tl.constexpr, A_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr,
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
        if PAIRS:
            for kk in tl.static_range(BLOCK_K // 32):
                kc = k0 + kk * 32
                a_even, a_odd = act_pair(h_ptr, hs_ptr, rows, valid, kc, stride_hm, stride_hsm,
                                         A_FP8, A_GROUP, BLOCK_M)  # fmt: skip
                w_even, w_odd = fp4_pair_tile(w_e, ws_e, w_rows, kc, stride_wn, stride_wsn, BLOCK_N)
                acc = tl.dot(a_even, tl.trans(w_even), acc)
                acc = tl.dot(a_odd, tl.trans(w_odd), acc)
        else:
            a = act_tile(h_ptr, hs_ptr, rows, valid, k0, stride_hm, stride_hsm,
                         A_FP8, A_GROUP, BLOCK_M, BLOCK_K)  # fmt: skip
            w = fp4_weight_tile(w_e, ws_e, w_rows, k0, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(w), acc)
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(acc, SOFT_ROUND), mask=valid[:, None])


@triton.jit
def moe_combine_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = ((y[t, 0] + y[t, 1]) + ...) + y[t, k-1]`` in fp32, slot order."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(y_ptr + token * TOP_K * N + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + cols, acc, mask=mask)
