"""Grouped GEMMs over FP4 (e2m1 + ue8m0) expert weights with one accumulator chained over the
whole of K (``MoeTiles.mma`` ``"mx"`` or ``"split"``): the default kernels from decode to prefill.

One program takes one block of an expert's rows (``BLOCK_M``, padded) against ``BLOCK_N`` weight
rows (gate and up together for the first GEMM) and walks K in ``BLOCK_K`` steps with
``acc = dot(w, a, acc)``, so the tensor cores never wait for a per-block rescale. Activations are
bf16 already through their FP8 round trip (``q * s`` is exact in bf16): the input by
``fp8_sim``, the hidden rows by the first GEMM's epilogue, so the K loop moves them straight from
global to shared memory and into the MMA. Two ways to unpack the weights (``UPCAST``):

- ``"mx"``: ``tl.dot_scaled`` with the weights as MXFP4 (e2m1 values, one ue8m0 scale per 32
  columns: exactly the checkpoint's format); Triton upcasts them to bf16 in registers (exact: an
  e2m1 value times a power of two).
- ``"split"``: ``split.split_block_dot``'s even/odd-split upcast, each row's largest scale
  applied to the accumulator after the loop.

Without ``SWAP_AB`` Triton (3.6, sm_90) puts the upcast weights on the wgmma's register side and
splits each K step into 16-deep MMAs left in flight while the next slice is upcast; with
``SWAP_AB`` (the weight rows on the MMA's M side, ``acc [BLOCK_N, BLOCK_M]``) it waits after
every step, which suits the split upcast. Prefill / middle batches use taller row blocks with
``GROUP_M`` > 0: a 1-D grid in :func:`block_and_tile`'s order, so each weight tile is read from
HBM once for an expert's blocks. ``WGMMA_FENCE`` waits for every wgmma at the top of each K step
(``common.wgmma_fence``); the unfenced defaults are shapes whose machine code already waits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.moe.common import store_hidden_dequantised, wgmma_fence
from deepinfer.kernels_nvidia.moe.split import row_max_exponent, split_block_dot
from deepinfer.kernels_nvidia.quant import to_bf16


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
def _program_block_tile(num_blocks, num_tiles, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: a 2-D grid (``GROUP_M == 0``: axis 0 the row
    blocks, axis 1 the column tiles) or :func:`block_and_tile`'s grouped order over a 1-D grid."""
    if GROUP_M == 0:
        block = tl.program_id(0)
        tile = tl.program_id(1)
    else:
        block, tile = block_and_tile(num_blocks, num_tiles, GROUP_M)
    return block, tile


@triton.jit
def _block_rows(row_slot_ptr, block, num_slots, BLOCK_M: tl.constexpr):
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_slot_ptr + rows)
    return rows, slots, slots < num_slots


@triton.jit
def _act_block(a_ptr, rows, valid, k0, stride_am, BLOCK_K: tl.constexpr):
    """bf16 columns ``k0 .. k0 + BLOCK_K`` of activation rows ``rows`` (invalid rows: 0)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=valid[:, None], other=0.0)
    return a.to(tl.bfloat16)


@triton.jit
def fp4_block_dot(
    acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + act @ W[w_rows, k0 : k0 + BLOCK_K]^T`` (``SWAP_AB``: ``acc + W @ act^T``) in fp32;
    ``"split"`` leaves out each row's ``2^(w_ref - 127)``."""
    if UPCAST == "split":
        acc = split_block_dot(acc, act, w_ptr, ws_ptr, w_rows, w_ref, k0, stride_wn, stride_wsn,
                              SWAP_AB, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        packed = tl.load(
            w_ptr + w_rows[:, None] * stride_wn + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
        )
        packed = packed.to(tl.uint8, bitcast=True)
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scales = tl.load(ws_ptr + w_rows[:, None] * stride_wsn + groups[None, :])
        if SWAP_AB:
            acc = tl.dot_scaled(packed, scales, "e2m1", tl.trans(act), None, "bf16", acc,
                                fast_math=True)  # fmt: skip
        else:
            acc = tl.dot_scaled(act, None, "bf16", tl.trans(packed), scales, "e2m1", acc,
                                fast_math=True)  # fmt: skip
    return acc


@triton.jit
def _row_ref(ws_ptr, w_rows, K, stride_wsn, UPCAST: tl.constexpr):
    """``"split"``: each weight row's largest scale exponent (int32); ``"mx"``: unused zeros."""
    if UPCAST == "split":
        w_ref = row_max_exponent(ws_ptr, w_rows, stride_wsn, K // 32, 32)
    else:
        w_ref = w_rows.to(tl.int32) * 0
    return w_ref


@triton.jit
def _row_factor(w_ref, UPCAST: tl.constexpr):
    if UPCAST == "split":
        factor = (w_ref << 23).to(tl.float32, bitcast=True)  # 2^(w_ref - 127)
    else:
        factor = w_ref.to(tl.float32) * 0 + 1.0
    return factor


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _rows_out(acc, factor, SWAP_AB: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` rows from the accumulator times each weight row's factor."""
    if SWAP_AB:
        out = tl.trans(acc * factor[:, None])
    else:
        out = acc * factor[None, :]
    return out


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def moe_stream_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, row_slot_ptr, block_expert_ptr, topk_w_ptr,
    num_slots, top_k, K, inter, limit, num_blocks,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
    OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr,
    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WGMMA_FENCE: tl.constexpr,
):  # fmt: skip
    """``h = q(bf16(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L) * router_w))`` for one block of
    an expert's rows and ``BLOCK_N`` hidden columns; gate and up rows in the same K loop."""
    block, tile = _program_block_tile(num_blocks, inter // BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows, slots, valid = _block_rows(row_slot_ptr, block, num_slots, BLOCK_M)
    tokens = tl.where(valid, slots // top_k, 0).to(tl.int64)
    col0 = tile * BLOCK_N
    gate_rows = (col0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    up_rows = gate_rows + inter
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    gate_ref = _row_ref(ws_e, gate_rows, K, stride_wsn, UPCAST)
    up_ref = _row_ref(ws_e, up_rows, K, stride_wsn, UPCAST)
    acc_gate = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_up = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        if WGMMA_FENCE:
            wgmma_fence(k0)
        a = _act_block(x_ptr, tokens, valid, k0, stride_xm, BLOCK_K)
        acc_gate = fp4_block_dot(acc_gate, a, w_e, ws_e, gate_rows, gate_ref, k0, stride_wn,
                                 stride_wsn, SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        acc_up = fp4_block_dot(acc_up, a, w_e, ws_e, up_rows, up_ref, k0, stride_wn, stride_wsn,
                               SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    gate = _rows_out(acc_gate, _row_factor(gate_ref, UPCAST), SWAP_AB)
    up = _rows_out(acc_up, _row_factor(up_ref, UPCAST), SWAP_AB)
    gate = tl.minimum(gate, limit)
    up = tl.clamp(up, -limit, limit)
    router_w = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    hidden = gate / (1.0 + tl.exp(-gate)) * up * router_w[:, None]
    store_hidden_dequantised(h_ptr, hidden, rows, col0, stride_hm,
                             OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def moe_stream_down_kernel(
    h_ptr, w_ptr, ws_ptr, y_ptr, row_slot_ptr, block_expert_ptr,
    num_slots, K, N, num_blocks, stride_hm, stride_we, stride_wn, stride_wse, stride_wsn,
    stride_ym,
    SOFT_ROUND: tl.constexpr, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WGMMA_FENCE: tl.constexpr,
):  # fmt: skip
    """``y[slot] = bf16(h w2^T)`` for one block of an expert's rows and ``BLOCK_N`` of the
    ``N`` output columns."""
    block, tile = _program_block_tile(num_blocks, N // BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows, slots, valid = _block_rows(row_slot_ptr, block, num_slots, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols.to(tl.int64)
    w_e = w_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_wse
    w_ref = _row_ref(ws_e, w_rows, K, stride_wsn, UPCAST)
    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        if WGMMA_FENCE:
            wgmma_fence(k0)
        a = _act_block(h_ptr, rows, valid, k0, stride_hm, BLOCK_K)
        acc = fp4_block_dot(acc, a, w_e, ws_e, w_rows, w_ref, k0, stride_wn, stride_wsn,
                            SWAP_AB, UPCAST, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    out = _rows_out(acc, _row_factor(w_ref, UPCAST), SWAP_AB)
    out_rows = tl.where(valid, slots, 0).to(tl.int64)
    ptrs = y_ptr + out_rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptrs, to_bf16(out, SOFT_ROUND), mask=valid[:, None])


def launch_gate_up(
    act, topk_weights, row_slot, block_expert, w13, w13_scale, *, top_k, group, limit, tiles,
    block_n, on_cpu,
):  # fmt: skip
    """``moe_stream_gate_up_kernel`` over the rows grouped by expert: bf16 ``act [T, D]`` (after
    its FP8 round trip). Returns bf16 ``h [capacity, I]`` after its own round trip."""
    dim, inter = act.shape[1], w13.shape[1] // 2
    h = torch.empty((row_slot.numel(), inter), dtype=act.dtype, device=act.device)
    w13s = w13_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    num_blocks = block_expert.numel()
    moe_stream_gate_up_kernel[_grid(num_blocks, inter // block_n, tiles.group_m)](
        act, w13, w13s, h, row_slot, block_expert, weights,
        act.shape[0] * top_k, top_k, dim, inter, limit, num_blocks,
        act.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1), h.stride(0),
        OUT_GROUP=group or 0, BLOCK_N=block_n, BLOCK_K=stream_block_k(dim, group, tiles.block_k),
        **_launch_flags(tiles, on_cpu),
    )  # fmt: skip
    return h


def launch_down(h, row_slot, block_expert, w2, w2_scale, *, num_slots, group, tiles, block_n,
                on_cpu):  # fmt: skip
    """``moe_stream_down_kernel``: bf16 ``y [num_slots, D]``, each row at its (token, slot)."""
    inter, dim = h.shape[1], w2.shape[1]
    y = torch.empty((num_slots, dim), dtype=torch.bfloat16, device=h.device)
    w2s = w2_scale.view(torch.uint8)
    num_blocks = block_expert.numel()
    moe_stream_down_kernel[_grid(num_blocks, dim // block_n, tiles.group_m)](
        h, w2, w2s, y, row_slot, block_expert, num_slots, inter, dim, num_blocks,
        h.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=stream_block_k(inter, group, tiles.block_k),
        **_launch_flags(tiles, on_cpu),
    )  # fmt: skip
    return y


def _grid(num_blocks: int, num_tiles: int, group_m: int) -> tuple[int, ...]:
    """2-D (blocks x tiles) for ``group_m == 0``, else 1-D in ``block_and_tile``'s order."""
    return (num_blocks, num_tiles) if group_m == 0 else (num_blocks * num_tiles,)


def _launch_flags(tiles, on_cpu) -> dict:
    return dict(
        SOFT_ROUND=on_cpu, SWAP_AB=tiles.swap_ab, UPCAST=tiles.mma, USE_ASM=not on_cpu,
        BLOCK_M=tiles.block_m, GROUP_M=tiles.group_m, WGMMA_FENCE=tiles.wgmma_fence and not on_cpu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def stream_block_k(k: int, group: int | None, wanted: int) -> int:
    """The K step: ``wanted`` if it divides ``k``, else the largest of 256..32 that does."""
    for block_k in (wanted, 256, 128, 64, 32):
        if k % block_k == 0 and block_k >= 32 and (group is None or k % group == 0):
            return block_k
    raise ValueError(f"K={k}: expected a multiple of 32 (and of act_quant_group={group})")
