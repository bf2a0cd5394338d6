"""MXFP4 weight block times bf16 activations with an even/odd split instead of an interleave
(``MoeTiles.mma="split"``, ``moe_stream``'s ``UPCAST="split"``).

A packed byte ``j`` of a weight row holds column ``k = 2j`` (low nibble) and ``k = 2j + 1`` (high
nibble). Instead of interleaving the two nibbles back into K order, the low nibbles of a
``[BLOCK_N, BLOCK_K / 2]`` byte tile become one bf16 tile and the high nibbles another, both in
the layout the bytes were loaded in, and the block is two products against the activation
columns ``0::2`` and ``1::2`` (a free register split of the loaded ``[BLOCK_M, BLOCK_K]`` rows):
``acc += W_lo a_even^T + W_hi a_odd^T``.

Upcast (exact): nibble ``v`` = sign bit 3, exponent bits 2..1, mantissa bit 0. The 16-bit pattern
``(v & 8) << 12 | (v & 7) << 6`` is the bf16 ``e2m1(v) * 2^-126`` (``e = 0`` lands on the bf16
subnormal ``m/2 * 2^-126``). One ``mul.rn.bf16x2`` (subnormal inputs kept: no flush-to-zero for
bf16 in PTX) by ``2^(126 - d)``, ``d = r - s``, ``r`` the weight row's largest scale exponent and
``s`` this 32-column group's, leaves ``e2m1(v) * 2^-d`` (exact while ``d <= 125``; ``d > 252``
multiplies by 0), and the row's ``2^(r - 127)`` is applied to the fp32 accumulator after the K
loop. Any ue8m0 scale is supported; a group more than 2^125 below its row's largest loses bits
(real checkpoints and the test weights have ``d <= 10``).

On the GPU (``USE_ASM``) 4 packed bytes become 8 bf16 in 16 integer instructions plus 4 bf16x2
multiplies (2 ``prmt`` byte spreads, then per pair of values a shift or two, a mask and a
``lop3``; the group's factor is a free ``.H0_H0`` operand): ~2.5 instructions per weight element.
The asm is not marked pure: as a pure elementwise op Triton 3.6 sometimes moved the conversion to
the wgmma's register-operand layout onto the packed bytes (byte-wide shared-memory gathers, ~5.3
instructions per element); impure, the bytes are read 16 at a time, upcast, stored to shared
memory and read back with ``ldmatrix``. sm_90 machine code of the K loop (Triton 3.6): ~3.6-3.9
instructions per weight element, against ~6.3 for ``tl.dot_scaled``'s upcast. Under the
interpreter the same bits are built with plain Triton ops in fp32.

Status (H200, 64 tokens, graph replay, results/2026-11-30-h200-moe-v5*.json): the down GEMM 586 /
960 us (V4-Flash / V4.1-Flash) = 1.57 / 1.53 TB/s, against 654 / 1,407 us for ``"mx"``; gate/up
as two weight tiles was slower than ``"mx"`` (1,707 vs 1,482 us), as one fused tile
(``moe_split_gate_up``) faster for V4.1-Flash only. A third fewer instructions gave 10-30%, so the
kernels are not bound by instruction issue alone: ~12 warps per SM, each K step waits for its
wgmmas and for a barrier around the shared-memory round trip (latency; not profiled).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
