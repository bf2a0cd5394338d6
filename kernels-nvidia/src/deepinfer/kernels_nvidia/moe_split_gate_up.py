"""Gate/up GEMM over FP4 experts with gate and up rows in one weight tile
(``MoeTiles(mma="split", fused_gate_up=True)``): ``moe_split``'s even/odd-split upcast on a
``[2 * BLOCK_N, BLOCK_K / 2]`` byte tile whose first ``BLOCK_N`` rows are gate rows
``col0 ..`` and last ``BLOCK_N`` the matching up rows ``inter + col0 ..``, against the expert's
``BLOCK_M`` token rows (the tokens on the wgmma's N side): one upcast, one product pair and one
wait per K step instead of two (``moe_stream_gate_up_kernel`` walks gate and up as two tiles).
The epilogue splits the accumulator back into gate and up and writes the hidden rows like
``moe_stream``: bf16 after their FP8 round trip per ``OUT_GROUP`` columns (``BLOCK_N`` a multiple
of it). Rows arrive grouped by expert in ``BLOCK_M`` blocks (``moe_experts.align_by_expert``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.moe_split import row_max_exponent, split_block_dot
from deepinfer.kernels_nvidia.moe_stream import _store_hidden_dequantised, wgmma_fence


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
    _store_hidden_dequantised(h_ptr, hidden, rows, col0, stride_hm,
                              OUT_GROUP, SOFT_ROUND, BLOCK_M, BLOCK_N)  # fmt: skip


def launch_fused_gate_up(act, topk_weights, row_slot, block_expert, w13, w13_scale, *, top_k,
                         group, limit, tiles, block_n, on_cpu):  # fmt: skip
    """``moe_split_gate_up_kernel`` over the rows grouped by expert: bf16 ``act [T, D]`` (after
    its FP8 round trip). Returns bf16 ``h [capacity, I]`` after its round trip and an unused
    placeholder scale (the ``(h, hs)`` of ``moe_stream_launch.launch_gate_up``)."""
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
        OUT_GROUP=group or 0, SOFT_ROUND=on_cpu, USE_ASM=tiles.use_asm and not on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WGMMA_FENCE=tiles.wgmma_fence and not on_cpu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return h, act.new_empty((1, 1), dtype=torch.float32)
