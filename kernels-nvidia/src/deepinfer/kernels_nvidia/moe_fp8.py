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
  The products are exact, but Hopper's FP8 MMA adds them with a short accumulator: measured on
  the H200, mean |error| ~0.2% of the output's spread (fp16: ~0), which exceeds the op's
  conformance tolerance at some shapes (the fp16 variant does not).

Status (H200, 2026-11-30, benchmarks/results/2026-11-30-h200-moe-v2.json): correct, but slower
than ``moe_gemm``'s bf16-upcast kernels (prefill 8,192 tokens 37 ms vs 22 ms; decode 64 tokens
5.8 ms vs 5.2 ms from a CUDA graph), so opt-in only. The MMA is waited on right after each
block (the promotion needs its result), so the expansion and the tensor cores never overlap.

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


@triton.jit
def nibbles_to_f16(packed, USE_ASM: tl.constexpr):
    """uint8 ``[R, C]`` packed e2m1 pairs -> (low nibbles, high nibbles) as fp16 ``[R, C]``
    holding ``e2m1 * 2^-14`` exactly."""
    if USE_ASM:
        # 4 packed bytes -> lo nibbles as 4 fp16, hi nibbles as 4 fp16 (e2m1 * 2^-14 each)
        lo, hi = tl.inline_asm_elementwise(
            """
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
""",
            "=r,=r,=r,=r,r", [packed],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        p = packed.to(tl.uint16)
        lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True)
        hi = (((p & 0x80) << 8) | ((p & 0x70) << 5)).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _byte_scales(ws_ptr, rows, k0, K, stride_wsn, GROUP: tl.constexpr):
    """int32 ``[BLOCK_N, GROUP / 2]``: the e8m0 scale of each packed byte's group in columns
    ``k0 .. k0 + GROUP`` (0 past ``K``). One value per 16 bytes: the load is a broadcast."""
    groups = k0 // 32 + tl.arange(0, GROUP // 2) // 16
    ptrs = ws_ptr + rows[:, None] * stride_wsn + groups[None, :]
    mask = (groups[None, :] < K // 32) & (rows[:, None] >= 0)
    return tl.load(ptrs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _weight_block(
    w_ptr, rows, k0, scales, stride_wn,
    GROUP: tl.constexpr, MMA_FP8: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Columns ``k0 .. k0 + GROUP`` of weight rows ``rows`` as ``[BLOCK_N, GROUP]`` e4m3 / fp16
    holding ``e2m1 * 2^(1 - d)``, and the fp32 scale ``2^(smax - 128)`` per row that promotes
    them; ``scales`` from :func:`_byte_scales`."""
    packed = tl.load(
        w_ptr + rows[:, None] * stride_wn + (k0 // 2 + tl.arange(0, GROUP // 2))[None, :]
    )
    smax = tl.max(scales, axis=1)
    d = smax[:, None] - scales
    factor = tl.where(d < 30, (30 - d) << 10, 0).to(tl.uint16).to(tl.float16, bitcast=True)
    lo, hi = nibbles_to_f16(packed.to(tl.uint8, bitcast=True), USE_ASM)
    w = tl.reshape(tl.join(lo * factor, hi * factor), (BLOCK_N, GROUP))  # natural order
    if MMA_FP8:
        w = w.to(tl.float8e4nv)
    scale_bits = (smax - 1) << 23
    return w, scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def fp4_rows_dot(
    a_ptr, as_ptr, a_rows, a_valid, w_ptr, ws_ptr, w_rows, K,
    stride_am, stride_asm, stride_wn, stride_wsn,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr,
    USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_M, BLOCK_N]`` (``SWAP_AB``: ``[BLOCK_N, BLOCK_M]``) of
    ``dequant(a[a_rows]) @ dequant(w[w_rows])^T`` over ``K`` columns: ``a`` e4m3 with fp32 scales
    per ``GROUP`` columns, ``w`` packed e2m1 with e8m0 scales per 32; one ``GROUP``-deep MMA per
    promotion into the fp32 accumulator. The scales are loaded one block ahead (their loads are
    not pipelined otherwise)."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, GROUP)[None, :]
    as_base = as_ptr + a_rows * stride_asm
    scales = _byte_scales(ws_ptr, w_rows, 0, K, stride_wsn, GROUP)
    a_scale = tl.load(as_base, mask=a_valid, other=0.0)
    for k0 in range(0, K, GROUP):
        next_scales = _byte_scales(ws_ptr, w_rows, k0 + GROUP, K, stride_wsn, GROUP)
        next_valid = a_valid & ((a_rows * 0 + k0 + GROUP) < K)
        next_a_scale = tl.load(as_base + (k0 + GROUP) // GROUP, mask=next_valid, other=0.0)
        w, w_scale = _weight_block(w_ptr, w_rows, k0, scales, stride_wn,
                                   GROUP, MMA_FP8, USE_ASM, BLOCK_N)  # fmt: skip
        a = tl.load(a_base + k0, mask=a_valid[:, None], other=0.0)
        if not MMA_FP8:
            a = a.to(tl.float16)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a)) * w_scale[:, None] * a_scale[None, :]
        else:
            acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
        scales = next_scales
        a_scale = next_a_scale
    return acc


@triton.jit
def block_and_tile(num_blocks, num_tiles, GROUP_M: tl.constexpr):
    """This program's (row block, column tile): ``GROUP_M`` consecutive row blocks (one expert's,
    mostly) sweep every column tile together, so their activation rows stay in L2 while each
    weight tile is streamed once for all of them."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_tiles
    first = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def moe_fp8_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row_slot_ptr, block_expert_ptr, topk_w_ptr,
    num_slots, top_k, K, inter, limit, num_blocks,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr,
    USE_ASM: tl.constexpr, OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``h = q(bf16(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L) * router_w))``: FP8 per
    ``OUT_GROUP`` columns (0: bf16, quantised by the caller), stored at the block's rows."""
    block, tile = block_and_tile(num_blocks, inter // BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    col0 = tile * BLOCK_N
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
                  OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N, False)  # fmt: skip


@triton.jit
def moe_fp8_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr, num_slots, K, N,
    num_blocks,
    stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    GROUP: tl.constexpr, SWAP_AB: tl.constexpr, MMA_FP8: tl.constexpr,
    USE_ASM: tl.constexpr, SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """``y[slot] = bf16(h w2^T)`` for the block's rows, scattered to their (token, slot) rows."""
    block, tile = block_and_tile(num_blocks, N // BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    valid = slots < num_slots
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = fp4_rows_dot(h_ptr, hs_ptr, rows, valid, w_ptr + expert * stride_we,
                       ws_ptr + expert * stride_wse, cols.to(tl.int64), K,
                       stride_hm, stride_hsm, stride_wn, stride_wsn,
                       GROUP, SWAP_AB, MMA_FP8, USE_ASM, BLOCK_M, BLOCK_N)  # fmt: skip
    if SWAP_AB:
        acc = tl.trans(acc)
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(acc, SOFT_ROUND), mask=valid[:, None])
