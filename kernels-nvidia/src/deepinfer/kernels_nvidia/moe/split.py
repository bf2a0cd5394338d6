"""The ``"split"`` family: an MXFP4 weight block times bf16 activations with an even/odd split
instead of an interleave (``MoeTiles.mma="split"``): the decode default's down GEMM, and its
gate/up for activation groups of up to 64 columns (one weight tile of gate and up rows).

A packed byte ``j`` of a weight row holds column ``k = 2j`` (low nibble) and ``k = 2j + 1`` (high
nibble). Instead of interleaving the two nibbles back into K order, the low nibbles of a
``[BLOCK_N, BLOCK_K / 2]`` byte tile become one bf16 tile and the high nibbles another, both in
the layout the bytes were loaded in, and the block is two products against the activation
columns ``0::2`` and ``1::2`` (a free register split of the loaded ``[BLOCK_M, BLOCK_K]`` rows):
``acc += W_lo a_even^T + W_hi a_odd^T``. This takes fewer instructions per weight element than
``tl.dot_scaled``'s upcast, which is what bounds a decode batch's expert GEMMs.

Upcast (exact): nibble ``v`` = sign bit 3, exponent bits 2..1, mantissa bit 0. The 16-bit pattern
``(v & 8) << 12 | (v & 7) << 6`` is the bf16 ``e2m1(v) * 2^-126`` (``e = 0`` lands on the bf16
subnormal ``m/2 * 2^-126``). One ``mul.rn.bf16x2`` (subnormal inputs kept: no flush-to-zero for
bf16 in PTX) by ``2^(126 - d)``, ``d = r - s``, ``r`` the weight row's largest scale exponent and
``s`` this 32-column group's, leaves ``e2m1(v) * 2^-d`` (exact while ``d <= 125``; ``d > 252``
multiplies by 0), and the row's ``2^(r - 127)`` is applied to the fp32 accumulator after the K
loop. Any ue8m0 scale is supported; a group more than 2^125 below its row's largest loses bits
(real checkpoints have small ``d``).

On the GPU (``USE_ASM``) 4 packed bytes become 8 bf16 in inline PTX (2 ``prmt`` byte spreads,
then per pair of values a shift or two, a mask and a ``lop3``; the group's factor is a free
``.H0_H0`` operand). The asm is not marked pure: as a pure elementwise op Triton 3.6 sometimes
moved the conversion to the wgmma's register-operand layout onto the packed bytes (byte-wide
shared-memory gathers); impure, the bytes are read 16 at a time, upcast, stored to shared memory
and read back with ``ldmatrix``. Under the interpreter the same bits are built with plain Triton
ops in fp32.

The fused gate/up kernel walks one ``[2 * BLOCK_N, BLOCK_K / 2]`` byte tile whose first
``BLOCK_N`` rows are gate rows ``col0 ..`` and last ``BLOCK_N`` the matching up rows
``inter + col0 ..``, against the expert's ``BLOCK_M`` token rows (the tokens on the wgmma's N
side): one upcast, one product pair and one wait per K step instead of two. Its epilogue splits
the accumulator back into gate and up and writes the hidden rows bf16 after their FP8 round trip
per ``OUT_GROUP`` columns (``BLOCK_N`` a multiple of it), as the ``"mx"`` gate/up does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.moe.common import store_hidden_dequantised, wgmma_fence


@triton.jit
def nibbles_to_bf16_scaled(packed, factor, USE_ASM: tl.constexpr):
    """uint8 ``[R, C]`` packed e2m1 pairs and bf16 ``factor [R, C]`` (a power of two per byte)
    -> (low nibbles, high nibbles) as bf16 ``[R, C]``: ``e2m1 * 2^-126 * factor``, exact."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            """
{
.reg .b32 z, t0, t1, a, b;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x1404;
prmt.b32 t1, $4, z, 0x3424;
shl.b32 a, t0, 4; shr.b32 b, t0, 2; and.b32 b, b, 0x01C001C0;
lop3.b32 a, a, b, 0x80008000, 0xEC;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, t1, 4; shr.b32 b, t1, 2; and.b32 b, b, 0x01C001C0;
lop3.b32 a, a, b, 0x80008000, 0xEC;
mul.rn.bf16x2 $1, a, $6;
shr.b32 b, t0, 6; and.b32 b, b, 0x01C001C0;
lop3.b32 a, t0, b, 0x80008000, 0xEC;
mul.rn.bf16x2 $2, a, $5;
shr.b32 b, t1, 6; and.b32 b, b, 0x01C001C0;
lop3.b32 a, t1, b, 0x80008000, 0xEC;
mul.rn.bf16x2 $3, a, $6;
}
""",
            "=r,=r,=r,=r,r,r,r", [packed, factor],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=False, pack=4,
        )  # fmt: skip
    else:
        p = packed.to(tl.uint32)
        scale = factor.to(tl.float32)
        lo_bits = ((p & 8) << 28) | ((p & 7) << 22)  # fp32 e2m1 * 2^-126
        hi_bits = ((p & 0x80) << 24) | ((p & 0x70) << 18)
        lo = (lo_bits.to(tl.float32, bitcast=True) * scale).to(tl.bfloat16)
        hi = (hi_bits.to(tl.float32, bitcast=True) * scale).to(tl.bfloat16)
    return lo, hi


@triton.jit
def row_max_exponent(ws_ptr, w_rows, stride_wsn, num_groups, CHUNK: tl.constexpr):
    """int32 ``[BLOCK_N]``: the largest ue8m0 scale exponent of each weight row ``w_rows`` over
    its ``num_groups`` 32-column groups, read ``CHUNK`` groups at a time (few registers)."""
    best = w_rows.to(tl.int32) * 0
    for g0 in range(0, num_groups, CHUNK):
        groups = g0 + tl.arange(0, CHUNK)
        ptrs = ws_ptr + w_rows[:, None] * stride_wsn + groups[None, :]
        scales = tl.load(ptrs, mask=groups[None, :] < num_groups, other=0)
        best = tl.maximum(best, tl.max(scales.to(tl.int32), axis=1))
    return best


@triton.jit
def split_factor(scales, w_ref):
    """bf16 ``2^(126 - d)``, ``d = w_ref[:, None] - scales`` (0 where ``d > 252``): the
    multiplier that turns the bit-placed ``e2m1 * 2^-126`` into ``e2m1 * 2^(s - w_ref)``."""
    d = w_ref[:, None] - scales.to(tl.int32)
    bits = tl.where(d <= 252, (253 - d) << 7, 0)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def split_block_dot(
    acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
    SWAP_AB: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + act @ W[w_rows, k0 : k0 + BLOCK_K]^T`` (``SWAP_AB``: ``acc + W @ act^T``) in
    fp32, leaving out each weight row's ``2^(w_ref - 127)``: ``act`` bf16 ``[BLOCK_M, BLOCK_K]``,
    ``w_ref`` int32 ``[BLOCK_N]`` (the row's largest scale exponent)."""
    packed = tl.load(
        w_ptr + w_rows[:, None] * stride_wn + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    ).to(tl.uint8, bitcast=True)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(ws_ptr + w_rows[:, None] * stride_wsn + groups[None, :])
    factor = split_factor(scales, w_ref)
    factor = tl.reshape(
        tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2)
    )
    w_lo, w_hi = nibbles_to_bf16_scaled(packed, factor, USE_ASM)
    a_even, a_odd = tl.split(tl.reshape(act, (BLOCK_M, BLOCK_K // 2, 2)))
    if SWAP_AB:
        acc = tl.dot(w_lo, tl.trans(a_even), acc)
        acc = tl.dot(w_hi, tl.trans(a_odd), acc)
    else:
        acc = tl.dot(a_even, tl.trans(w_lo), acc)
        acc = tl.dot(a_odd, tl.trans(w_hi), acc)
    return acc


@triton.jit(do_not_specialize=["num_slots"])
def moe_split_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, row_slot_ptr, block_expert_ptr, topk_w_ptr,
    num_slots, top_k, K, inter, limit,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
    OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WGMMA_FENCE: tl.constexpr,
):  # fmt: skip
    """``h = q(bf16(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L) * router_w))`` for one block of
    an expert's rows (axis 0) and ``BLOCK_N`` hidden columns (axis 1)."""
    block = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    i = tl.arange(0, 2 * BLOCK_N)
    w_rows = tl.where(i < BLOCK_N, col0 + i, inter + col0 + i - BLOCK_N).to(tl.int64)
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    w_ref = row_max_exponent(ws_e, w_rows, stride_wsn, K // 32, 32)
    acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if WGMMA_FENCE:
            wgmma_fence(k0)
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + cols[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        acc = split_block_dot(acc, a, w_e, ws_e, w_rows, w_ref, k0, stride_wn, stride_wsn,
                              True, USE_ASM, BLOCK_M, 2 * BLOCK_N, BLOCK_K)  # fmt: skip
    acc = acc * (w_ref << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(w_ref - 127)
    both = tl.permute(tl.reshape(tl.trans(acc), (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
    gate, up = tl.split(both)
    gate = tl.minimum(gate, limit)
    up = tl.clamp(up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    store_hidden_dequantised(h_ptr, hidden, rows, col0, stride_hm,
                             OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N)  # fmt: skip


def launch_fused_gate_up(act, topk_weights, row_slot, block_expert, w13, w13_scale, *, top_k,
                         group, limit, tiles, block_n, on_cpu):  # fmt: skip
    """``moe_split_gate_up_kernel`` over the rows grouped by expert: bf16 ``act [T, D]`` (after
    its FP8 round trip). Returns bf16 ``h [capacity, I]`` after its own round trip."""
    dim, inter = act.shape[1], w13.shape[1] // 2
    if group is not None and block_n % group:
        raise ValueError(f"fused gate/up: block_n={block_n} must be a multiple of "
                         f"act_quant_group={group}")  # fmt: skip
    h = torch.empty((row_slot.numel(), inter), dtype=torch.bfloat16, device=act.device)
    w13s = w13_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    block_k = next(k for k in (tiles.block_k, 128, 64, 32) if dim % k == 0)
    moe_split_gate_up_kernel[(block_expert.numel(), inter // block_n)](
        act, w13, w13s, h, row_slot, block_expert, weights,
        act.shape[0] * top_k, top_k, dim, inter, limit,
        act.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1), h.stride(0),
        OUT_GROUP=group or 0, SOFT_ROUND=on_cpu, USE_ASM=not on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WGMMA_FENCE=tiles.wgmma_fence and not on_cpu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return h
