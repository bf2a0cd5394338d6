"""Grouped GEMMs over FP4 (e2m1 + ue8m0) expert weights on the FP8 (or fp16) tensor cores.

The packed weights are expanded in registers to FP8 e4m3 (``MMA_FP8``) or fp16 and multiplied
against the FP8 activations (e4m3 + an fp32 power-of-two scale per ``GROUP`` columns) with every
product exact, so only the accumulation order differs from the reference:

- nibble -> fp16 by bit placement: ``s e e m`` -> sign bit 15, ``e e m`` at bits 11..9, which reads
  as ``e2m1 * 2^-14`` for every code (the subnormal 0.5 included); on the GPU 4 bytes at a time in
  inline PTX (shifts and masks on 32-bit registers), under the interpreter in plain Triton ops;
- the four 32-column scale groups of a ``GROUP``-column block differ by ``d = smax - s`` octaves;
  an fp16 multiply by ``2^(15 - d)`` leaves ``e2m1 * 2^(1 - d)``, exact in fp16, and exact in e4m3
  while ``d <= 9`` (a group 512 times smaller than its block's largest rounds to e4m3
  subnormals; ``d >= 30`` drops to zero). Real checkpoints and the test weights have ``d <= 3``;
- per ``GROUP`` columns the MMA partial sum is promoted to the fp32 accumulator times the
  activation scale (per row) and ``2^(smax - 128)`` (per weight row): DeepGEMM's 1x128 scheme.

``SWAP_AB`` computes ``W x^T`` instead of ``x W^T``: the weight rows fill the MMA's 64-row side
and the few tokens of a decode step its narrow side (16), so nothing is padded to 64 rows.

Rows arrive grouped by expert in blocks of ``BLOCK_M`` (``moe_experts.align_by_expert``):
``block_expert[b]`` is block ``b``'s expert (-1: unused block), ``row_slot[r]`` the flat (token,
slot) index of row ``r`` (``num_slots``: padding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels_nvidia.moe_gemm import _store_hidden
from deepinfer.kernels_nvidia.quant import to_bf16

# 4 packed bytes (8 nibbles) -> lo nibbles as 4 fp16, hi nibbles as 4 fp16 (e2m1 * 2^-14 each)
_NIBBLES_TO_F16 = """
{
.reg .b32 z, t0, t1, u, v;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shl.b32 u, t0, 12; shl.b32 v, t0, 9; and.b32 u, u, 0x80008000; and.b32 v, v, 0x0E000E00;
or.b32 $0, u, v;
shl.b32 u, t1, 12; shl.b32 v, t1, 9; and.b32 u, u, 0x80008000; and.b32 v, v, 0x0E000E00;
or.b32 $1, u, v;
shl.b32 u, t0, 8; shl.b32 v, t0, 5; and.b32 u, u, 0x80008000; and.b32 v, v, 0x0E000E00;
or.b32 $2, u, v;
shl.b32 u, t1, 8; shl.b32 v, t1, 5; and.b32 u, u, 0x80008000; and.b32 v, v, 0x0E000E00;
or.b32 $3, u, v;
}
"""


@triton.jit
def nibbles_to_f16(packed, USE_ASM: tl.constexpr):
    """uint8 ``[R, C]`` packed e2m1 pairs -> (low nibbles, high nibbles) as fp16 ``[R, C]``
    holding ``e2m1 * 2^-14`` exactly."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _NIBBLES_TO_F16, "=r,=r,=r,=r,r", [packed],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        p = packed.to(tl.uint16)
        lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True)
        hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _weight_group(
    w_ptr, ws_ptr, rows, group, smax, stride_wn, stride_wsn,
    MMA_FP8: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Columns ``32 * group ..`` of weight rows ``rows`` as ``[BLOCK_N, 32]`` e4m3 / fp16 holding
    ``e2m1 * 2^(1 - d)`` with ``d = smax - scale`` (see the module docstring)."""
    packed = tl.load(w_ptr + rows[:, None] * stride_wn + (group * 16 + tl.arange(0, 16))[None, :])
    lo, hi = nibbles_to_f16(packed.to(tl.uint8, bitcast=True), USE_ASM)
    d = smax - tl.load(ws_ptr + rows * stride_wsn + group).to(tl.int32)
    factor_bits = tl.where(d < 30, (30 - d) << 10, 0).to(tl.uint16)
    factor = factor_bits.to(tl.float16, bitcast=True)[:, None]
    w = tl.reshape(tl.join(lo * factor, hi * factor), (BLOCK_N, 32))  # natural column order
    if MMA_FP8:
        w = w.to(tl.float8e4nv)
    return w


@triton.jit
def fp4_rows_dot(
    a_ptr, as_ptr, a_rows, a_valid, w_ptr, ws_ptr, w_rows, K,
    stride_am, stride_asm, stride_wn, stride_wsn,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_M, BLOCK_N]`` (``SWAP_AB``: ``[BLOCK_N, BLOCK_M]``) of
    ``dequant(a[a_rows]) @ dequant(w[w_rows])^T`` over ``K`` columns; ``a`` is e4m3 with fp32
    scales per ``GROUP`` columns, ``w`` packed e2m1 with e8m0 scales per 32."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, 32)[None, :]
    ws_base = ws_ptr + w_rows * stride_wsn
    for k0 in range(0, K, GROUP):
        g0 = k0 // 32
        smax = tl.load(ws_base + g0).to(tl.int32)
        for g in tl.static_range(1, GROUP // 32):
            smax = tl.maximum(smax, tl.load(ws_base + g0 + g).to(tl.int32))
        if SWAP_AB:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in tl.static_range(GROUP // 32):
            w = _weight_group(w_ptr, ws_ptr, w_rows, g0 + g, smax, stride_wn, stride_wsn,
                              MMA_FP8, USE_ASM, BLOCK_N)  # fmt: skip
            a = tl.load(a_base + k0 + 32 * g, mask=a_valid[:, None], other=0.0)
            if not MMA_FP8:
                a = a.to(tl.float16)
            if SWAP_AB:
                part = tl.dot(w, tl.trans(a), part)
            else:
                part = tl.dot(a, tl.trans(w), part)
        a_scale = tl.load(as_ptr + a_rows * stride_asm + k0 // GROUP, mask=a_valid, other=0.0)
        w_scale = ((smax - 1) << 23).to(tl.float32, bitcast=True)  # 2^(smax - 128)
        if SWAP_AB:
            acc += part * w_scale[:, None] * a_scale[None, :]
        else:
            acc += part * a_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit
def moe_fp8_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row_slot_ptr, block_expert_ptr, topk_w_ptr,
    num_slots, top_k, K, inter, limit,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr, USE_ASM: tl.constexpr,
    SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``h = q(bf16(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L) * router_w))``: FP8 per
    ``GROUP`` columns, stored at the block's rows."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_N
    gate_rows = (col0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    gate = fp4_rows_dot(x_ptr, xs_ptr, tokens, valid, w_e, ws_e, gate_rows, K,
                        stride_xm, stride_xsm, stride_wn, stride_wsn,
                        GROUP, SWAP_AB, MMA_FP8, USE_ASM, BLOCK_M, BLOCK_N)  # fmt: skip
    up = fp4_rows_dot(x_ptr, xs_ptr, tokens, valid, w_e, ws_e, gate_rows + inter, K,
                      stride_xm, stride_xsm, stride_wn, stride_wsn,
                      GROUP, SWAP_AB, MMA_FP8, USE_ASM, BLOCK_M, BLOCK_N)  # fmt: skip
    if SWAP_AB:
        gate = tl.trans(gate)
        up = tl.trans(up)
    gate = tl.minimum(gate, limit)
    up = tl.clamp(up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    _store_hidden(h_ptr, hs_ptr, hidden, rows, col0, stride_hm, stride_hsm,
                  GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N, False)  # fmt: skip


@triton.jit
def moe_fp8_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr, num_slots, K,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr, USE_ASM: tl.constexpr,
    SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``y[slot] = bf16(h w2^T)`` for the block's rows, scattered to their (token, slot) rows."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = fp4_rows_dot(h_ptr, hs_ptr, rows, valid, w_ptr + expert * stride_we,
                       ws_ptr + expert * stride_wse, cols.to(tl.int64), K,
                       stride_hm, stride_hsm, stride_wn, stride_wsn,
                       GROUP, SWAP_AB, MMA_FP8, USE_ASM, BLOCK_M, BLOCK_N)  # fmt: skip
    if SWAP_AB:
        acc = tl.trans(acc)
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(acc, SOFT_ROUND), mask=valid[:, None])
