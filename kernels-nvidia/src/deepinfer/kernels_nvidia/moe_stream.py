"""Decode-shaped grouped GEMMs over FP4 (e2m1 + ue8m0) expert weights: one accumulator chained
over the whole of K, so the tensor cores never wait for a per-block rescale.

For a decode batch each touched expert sees one or two rows, so the work is streaming the
expert's packed weights. One program takes one expert's rows (``BLOCK_M``, padded) against
``BLOCK_N`` weight rows (gate and up together for the first GEMM) and walks K in ``BLOCK_K``
steps with ``acc = dot(w, a, acc)``: no per-block rescale waits for the product. Without
``SWAP_AB`` Triton (3.6, sm_90) puts the upcast weights on the wgmma's register side and splits
each K step into 16-deep MMAs left in flight while the next slice is upcast; with ``SWAP_AB`` it
waits after every step (slower, measured). Two ways to unpack the weights:

- ``UPCAST="mx"``: ``tl.dot_scaled`` with the weights as MXFP4 (e2m1 values, one ue8m0 scale per
  32 columns: exactly the checkpoint's format) against bf16 activations; Triton upcasts them to
  bf16 in registers (exact: an e2m1 value times a power of two).
- ``UPCAST="fp16"``: the nibbles become fp16 ``e2m1 * 2^-14`` by bit placement (``nibbles_to_f16``)
  and one fp16 multiply by ``2^(14 - d)``, ``d`` = the row's largest scale exponent minus this
  group's (``d <= 23`` exact; real and test weights have ``d <= 3``), so the whole row shares one
  fp32 factor ``2^(ref - 127)`` applied after the loop. Activations likewise: ``q * s / s_ref``
  in fp16 with the row's largest group scale ``s_ref`` (exact while ``s_ref / s <= 2^15``).

``SWAP_AB``: the weight rows are the MMA's M side (``acc [BLOCK_N, BLOCK_M]``), the few tokens
its N side. Activations are FP8 e4m3 with fp32 scales per ``GROUP`` columns (``A_FP8``; the fp16
upcasts) or bf16, for ``"mx"`` already through their FP8 round trip (``q * s`` is exact in bf16):
the input by ``fp8_sim``, the hidden rows by the first GEMM's epilogue (``OUT_DEQUANT``), so the
K loop moves them straight from global to shared memory and into the MMA.
Rows arrive grouped by expert in ``BLOCK_M`` blocks as in ``moe_gemm``: ``block_expert[b]``
(-1: unused block) and ``row_slot[r]`` (``num_slots``: padding).

Prefill / middle batches: 32- to 128-row blocks (``moe_experts.STREAM_TILES``), ``GROUP_M`` > 0
(1-D grid in ``block_and_tile``'s order: each weight tile read from HBM once for an expert's
blocks); ``ROW_UNIT`` > 0 (``MoeTiles.split_tail``): first rows from a list of layout blocks
(``moe_align.split_programs``). H200 at 174611d, 8,192 tokens, 128 x 128, K step 128: V4-Flash
11.5 ms = 214 TFLOP/s effective, V4.1-Flash 17.4 ms = 200 (22.5 / 33.2 ms before), i.e. ~285
TFLOP/s executed on a layout 75% real rows: what bounds it is the e2m1 -> bf16 upcast on the
wgmma's register side (~240 instructions per thread per 64-deep K step), not overlapped with
the MMAs where ptxas waits for each wgmma, and the padding of each expert's last block.

Hazard (sm_90 machine code, Triton 3.6): where the K loop leaves wgmmas in flight across its
back-edge (``WARPGROUP.DEPBAR.LE gsb0, N``, N > 0), the next step's upcast overwrites their
register A operands before they complete (undefined in PTX; triton-lang/triton#9433, fixed after
3.6: the CPU venv's Triton 3.9 waits at the loop top): 128 x 128 with K step 64 gave wrong rows
on the H200. The prefill / middle defaults are shapes where ptxas waits for every wgmma;
the decode default's down kernel has the pattern (its tests pass). ``MoeTiles.wgmma_fence``
(opt-in, not yet run on a GPU) waits at the top of each K step (``wgmma_fence``), which removes
the pattern from the machine code of every shape checked.

Status (H200, 64 tokens, bench_moe.py at 0aa26a9, results/2026-11-30-h200-moe-v3-decode.json):
``"mx"`` 16x128, K step 256, 8 warps, 3 stages (the decode default): V4-Flash 2.23 ms from a
CUDA graph = 1.24 TB/s of FP4 expert bytes (the bf16-upcast default before: 5.15 ms), V4.1-Flash
3.85 ms = 1.15 TB/s; ``"fp16-stream"`` 3.14 / 7.45 ms. What bounds it (sm_90 machine code): the
upcast costs ~5.5-6 instructions per weight element (Triton's e2m1 -> bf16 table in byte
permutes, byte-wide shared loads to gather the MMA fragment, the bf16 scale multiply), an issue
floor of ~0.9 ms for V4-Flash, reached at ~40%; the weights' K-contiguous bytes do not match the
MMA fragment layout, so wide loads need a shuffled weight layout (not this op's contract).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels_nvidia.moe_fp8 import block_and_tile, nibbles_to_f16
from deepinfer.kernels_nvidia.moe_gemm import _store_hidden
from deepinfer.kernels_nvidia.moe_split import row_max_exponent, split_block_dot
from deepinfer.kernels_nvidia.quant import pow2_scale, to_bf16, to_e4m3


@triton.jit
def row_max(ptr, rows, valid, stride, num_cols, NUM_COLS_P2: tl.constexpr):
    """Max over the first ``num_cols`` entries of each row ``rows`` (0 for invalid rows)."""
    cols = tl.arange(0, NUM_COLS_P2)
    mask = valid[:, None] & (cols[None, :] < num_cols)
    values = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0)
    return tl.max(values, axis=1)


@triton.jit
def act_block(
    a_ptr, as_ptr, rows, valid, a_ref, k0, stride_am, stride_asm,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Columns ``k0 .. k0 + BLOCK_K`` of activation rows ``rows`` (invalid rows: 0): e4m3 ones
    as fp16 ``q * s / a_ref`` (``"fp16"``) or bf16 ``q * s``; bf16 ones pass through."""
    cols = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=valid[:, None], other=0.0)
    if A_FP8:
        # one scale per GROUP columns, loaded per column (the repeated addresses broadcast)
        s_ptrs = as_ptr + rows[:, None] * stride_asm + (cols // GROUP)[None, :]
        scale = tl.load(s_ptrs, mask=valid[:, None], other=0.0)
        if UPCAST == "mx":
            out = (a.to(tl.float32) * scale).to(tl.bfloat16)
        else:
            out = (a.to(tl.float32) * (scale / a_ref[:, None])).to(tl.float16)
    else:
        out = a.to(tl.bfloat16)
    return out


@triton.jit
def _times_group_factor(half, factor, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K / 2]`` fp16 nibble values (16 per 32-column group) times their
    group's fp16 factor ``[BLOCK_N, BLOCK_K / 32]``."""
    grouped = tl.reshape(half, (BLOCK_N, BLOCK_K // 32, 16)) * factor[:, :, None]
    return tl.reshape(grouped, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def fp4_block_dot(
    acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + act @ W[w_rows, k0 : k0 + BLOCK_K]^T`` (``SWAP_AB``: ``acc + W @ act^T``) in fp32;
    ``"fp16"`` and ``"split"`` leave out each row's ``2^(w_ref - 127)``."""
    if UPCAST == "split":
        acc = split_block_dot(acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
                              SWAP_AB, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        acc = _packed_block_dot(acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
                                SWAP_AB, UPCAST, USE_ASM, BLOCK_N, BLOCK_K)  # fmt: skip
    return acc


@triton.jit
def _packed_block_dot(
    acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """:func:`fp4_block_dot` for ``"mx"`` and ``"fp16"``: the weights interleaved back into K
    order."""
    packed = tl.load(
        w_ptr + w_rows[:, None] * stride_wn + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    )
    packed = packed.to(tl.uint8, bitcast=True)
    if UPCAST == "mx":
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scales = tl.load(ws_ptr + w_rows[:, None] * stride_wsn + groups[None, :])
        if SWAP_AB:
            acc = tl.dot_scaled(packed, scales, "e2m1", tl.trans(act), None, "bf16", acc,
                                fast_math=True)  # fmt: skip
        else:
            acc = tl.dot_scaled(act, None, "bf16", tl.trans(packed), scales, "e2m1", acc,
                                fast_math=True)  # fmt: skip
    else:
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scales = tl.load(ws_ptr + w_rows[:, None] * stride_wsn + groups[None, :])
        d = w_ref[:, None] - scales.to(tl.int32)
        factor = tl.where(d <= 28, (29 - d) << 10, 0).to(tl.uint16).to(tl.float16, bitcast=True)
        lo, hi = nibbles_to_f16(packed, USE_ASM)
        lo = _times_group_factor(lo, factor, BLOCK_N, BLOCK_K)
        hi = _times_group_factor(hi, factor, BLOCK_N, BLOCK_K)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(act), acc)
        else:
            acc = tl.dot(act, tl.trans(w), acc)
    return acc


@triton.jit
def _program_block_tile(num_blocks, num_tiles, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: a 2-D grid (``GROUP_M == 0``: axis 0 the row
    blocks, axis 1 the column tiles) or ``block_and_tile``'s grouped order over a 1-D grid."""
    if GROUP_M == 0:
        block = tl.program_id(0)
        tile = tl.program_id(1)
    else:
        block, tile = block_and_tile(num_blocks, num_tiles, GROUP_M)
    return block, tile


@triton.jit
def _block_start(block_list_ptr, block_expert_ptr, block, BLOCK_M: tl.constexpr,
                 ROW_UNIT: tl.constexpr):  # fmt: skip
    """(first row, expert; -1: nothing to do) of row block ``block``: ``ROW_UNIT == 0``: the
    layout's block ``block``; else the layout block ``block_list[block]`` (-1: none) of
    ``ROW_UNIT`` rows, where this program's ``BLOCK_M`` rows start (a multiple of it)."""
    if ROW_UNIT == 0:
        unit = block.to(tl.int64)
        first_row = unit * BLOCK_M
    else:
        unit = tl.load(block_list_ptr + block).to(tl.int64)
        first_row = unit * ROW_UNIT
    expert = tl.load(block_expert_ptr + tl.maximum(unit, 0)).to(tl.int64)
    return first_row, tl.where(unit >= 0, expert, -1)


@triton.jit
def _block_rows(row_slot_ptr, first_row, num_slots, BLOCK_M: tl.constexpr):
    rows = first_row + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    return rows, slots, slots < num_slots


@triton.jit
def _refs(
    ws_ptr, w_rows, as_ptr, a_rows, a_valid, K, stride_wsn, stride_asm,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr, KG_P2: tl.constexpr,
    KA_P2: tl.constexpr,
):  # fmt: skip
    """``"fp16"``: each weight row's largest scale exponent (int32) and each activation row's
    largest group scale (fp32, 1 for padding rows); ``"split"``: the weight rows' only; other
    upcasts: unused placeholders."""
    if UPCAST == "fp16":
        w_ref = row_max(ws_ptr, w_rows, w_rows >= 0, stride_wsn, K // 32, KG_P2).to(tl.int32)
        a_ref = row_max(as_ptr, a_rows, a_valid, stride_asm, K // GROUP, KA_P2)
        a_ref = tl.where(a_valid, a_ref, 1.0)
    elif UPCAST == "split":
        w_ref = row_max_exponent(ws_ptr, w_rows, stride_wsn, K // 32, 32)
        a_ref = a_rows.to(tl.float32) * 0 + 1.0
    else:
        w_ref = w_rows.to(tl.int32) * 0
        a_ref = a_rows.to(tl.float32) * 0 + 1.0
    return w_ref, a_ref


@triton.jit
def wgmma_fence(x):
    """Wait until every wgmma this warpgroup issued has completed (``wgmma.wait_group 0``);
    returns ``x``. At the top of the K loop it keeps the next step's upcast from overwriting
    the register operands of wgmmas still in flight (the "Hazard" above)."""
    return tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;\n mov.b32 $0, $1;", "=r,r",
                                     [x], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _row_factor(w_ref, UPCAST: tl.constexpr):
    if UPCAST == "fp16" or UPCAST == "split":
        factor = (w_ref << 23).to(tl.float32, bitcast=True)  # 2^(w_ref - 127)
    else:
        factor = w_ref.to(tl.float32) * 0 + 1.0
    return factor


@triton.jit
def _store_hidden_dequantised(
    h_ptr, hidden, rows, col0, stride_hm,
    OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store bf16 ``q * s``: bf16(hidden) through its FP8 round trip per ``OUT_GROUP`` columns
    (0: none), exact in bf16, so the next GEMM reads plain bf16 rows."""
    hidden = to_bf16(hidden, SOFT_ROUND).to(tl.float32)
    if OUT_GROUP > 0:
        grouped = tl.reshape(hidden, (BLOCK_M, BLOCK_N // OUT_GROUP, OUT_GROUP))
        scale = pow2_scale(tl.max(tl.abs(grouped), axis=2), 1e-4, 448.0)
        q = to_e4m3(grouped / scale[:, :, None], SOFT_ROUND).to(tl.float32)
        hidden = tl.reshape(q * scale[:, :, None], (BLOCK_M, BLOCK_N))
    cols = col0 + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], hidden.to(tl.bfloat16))


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def moe_stream_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row_slot_ptr, block_expert_ptr, block_list_ptr,
    topk_w_ptr, num_slots, top_k, K, inter, limit, num_blocks,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm, stride_hsm,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, OUT_GROUP: tl.constexpr, OUT_DEQUANT: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KG_P2: tl.constexpr, KA_P2: tl.constexpr, GROUP_M: tl.constexpr, ROW_UNIT: tl.constexpr,
    WGMMA_FENCE: tl.constexpr,
):  # fmt: skip
    """``h = q(bf16(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L) * router_w))`` for one block of
    an expert's rows and ``BLOCK_N`` hidden columns; gate and up rows in the same K loop."""
    block, tile = _program_block_tile(num_blocks, inter // BLOCK_N, GROUP_M)
    first_row, expert = _block_start(block_list_ptr, block_expert_ptr, block, BLOCK_M, ROW_UNIT)
    if expert < 0:
        return
    rows, slots, valid = _block_rows(row_slot_ptr, first_row, num_slots, BLOCK_M)
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    col0 = tile * BLOCK_N
    gate_rows = (col0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    up_rows = gate_rows + inter
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    gate_ref, x_ref = _refs(ws_e, gate_rows, xs_ptr, tokens, valid, K, stride_wsn, stride_xsm,
                            A_FP8, GROUP, UPCAST, KG_P2, KA_P2)  # fmt: skip
    up_ref, _ = _refs(ws_e, up_rows, xs_ptr, tokens, valid, K, stride_wsn, stride_xsm,
                      A_FP8, GROUP, UPCAST, KG_P2, KA_P2)  # fmt: skip
    acc_gate = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_up = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        if WGMMA_FENCE:
            wgmma_fence(k0)
        a = act_block(x_ptr, xs_ptr, tokens, valid, x_ref, k0, stride_xm, stride_xsm,
                      A_FP8, GROUP, UPCAST, BLOCK_K)  # fmt: skip
        acc_gate = fp4_block_dot(acc_gate, a, w_e, ws_e, gate_rows, gate_ref, k0, stride_wn,
                                 stride_wsn, SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        acc_up = fp4_block_dot(acc_up, a, w_e, ws_e, up_rows, up_ref, k0, stride_wn, stride_wsn,
                               SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    if SWAP_AB:
        gate = tl.trans(acc_gate * _row_factor(gate_ref, UPCAST)[:, None])
        up = tl.trans(acc_up * _row_factor(up_ref, UPCAST)[:, None])
    else:
        gate = acc_gate * _row_factor(gate_ref, UPCAST)[None, :]
        up = acc_up * _row_factor(up_ref, UPCAST)[None, :]
    if UPCAST == "fp16":
        gate = gate * x_ref[:, None]
        up = up * x_ref[:, None]
    gate = tl.minimum(gate, limit)
    up = tl.clamp(up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    if OUT_DEQUANT:
        _store_hidden_dequantised(h_ptr, hidden, rows, col0, stride_hm,
                                  OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N)  # fmt: skip
    else:
        _store_hidden(h_ptr, hs_ptr, hidden, rows, col0, stride_hm, stride_hsm,
                      OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N, False)  # fmt: skip


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def moe_stream_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr, block_list_ptr,
    num_slots, K, N, num_blocks, stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    A_FP8: tl.constexpr, GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KG_P2: tl.constexpr, KA_P2: tl.constexpr, GROUP_M: tl.constexpr, ROW_UNIT: tl.constexpr,
    WGMMA_FENCE: tl.constexpr,
):  # fmt: skip
    """``y[slot] = bf16(h w2^T)`` for one block of an expert's rows and ``BLOCK_N`` of the
    ``N`` output columns."""
    block, tile = _program_block_tile(num_blocks, N // BLOCK_N, GROUP_M)
    first_row, expert = _block_start(block_list_ptr, block_expert_ptr, block, BLOCK_M, ROW_UNIT)
    if expert < 0:
        return
    rows, slots, valid = _block_rows(row_slot_ptr, first_row, num_slots, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols.to(tl.int64)
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    w_ref, h_ref = _refs(ws_e, w_rows, hs_ptr, rows, valid, K, stride_wsn, stride_hsm,
                         A_FP8, GROUP, UPCAST, KG_P2, KA_P2)  # fmt: skip
    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        if WGMMA_FENCE:
            wgmma_fence(k0)
        a = act_block(h_ptr, hs_ptr, rows, valid, h_ref, k0, stride_hm, stride_hsm,
                      A_FP8, GROUP, UPCAST, BLOCK_K)  # fmt: skip
        acc = fp4_block_dot(acc, a, w_e, ws_e, w_rows, w_ref, k0, stride_wn, stride_wsn,
                            SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    if SWAP_AB:
        out = tl.trans(acc * _row_factor(w_ref, UPCAST)[:, None])
    else:
        out = acc * _row_factor(w_ref, UPCAST)[None, :]
    if UPCAST == "fp16":
        out = out * h_ref[:, None]
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(out, SOFT_ROUND), mask=valid[:, None])
