"""Host launchers of ``moe_stream``'s kernels: allocate, pick the grid and the K step, launch."""

from __future__ import annotations

import torch
import triton

from deepinfer.kernels_nvidia.moe_stream import moe_stream_down_kernel, moe_stream_gate_up_kernel


def launch_gate_up(
    act, act_scale, topk_weights, row_slot, block_expert, w13, w13_scale, *, top_k, group, limit,
    tiles, upcast, block_n, on_cpu, block_list=None, row_unit=0, out=None,
):  # fmt: skip
    """``moe_stream_gate_up_kernel`` over the rows grouped by expert: ``act [T, D]`` (e4m3 with
    fp32 ``act_scale [T, D / group]`` for the fp16 upcast, else bf16). Returns ``(h, hs)``:
    ``h [capacity, I]`` e4m3 + fp32 scales (fp16 upcast) or bf16 after its FP8 round trip
    (``out``: written into, only the rows of the programs' blocks). ``block_list``: the
    programs' first layout blocks of ``row_unit`` rows (-1: none), else one program per block."""
    dim, inter = act.shape[1], w13.shape[1] // 2
    a_fp8 = act.dtype == torch.float8_e4m3fn
    capacity = row_slot.numel()
    if out is None:
        out = (torch.empty((capacity, inter), dtype=act.dtype, device=act.device),
               torch.empty((capacity, inter // group if a_fp8 else 1), dtype=torch.float32,
                           device=act.device))  # fmt: skip
    h, hs = out
    w13s = w13_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    num_blocks = (block_expert if block_list is None else block_list).numel()
    moe_stream_gate_up_kernel[_grid(num_blocks, inter // block_n, tiles.group_m)](
        act, act_scale, w13, w13s, h, hs, row_slot, block_expert,
        block_expert if block_list is None else block_list, weights,
        act.shape[0] * top_k, top_k, dim, inter, limit, num_blocks,
        act.stride(0), act_scale.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0),
        w13s.stride(1), h.stride(0), hs.stride(0),
        OUT_GROUP=group or 0, OUT_DEQUANT=not a_fp8, BLOCK_N=block_n, ROW_UNIT=row_unit,
        BLOCK_K=stream_block_k(dim, group, tiles.block_k),
        **_launch_flags(dim, group, a_fp8, tiles, upcast, on_cpu),
    )  # fmt: skip
    return h, hs


def launch_down(
    h, hs, row_slot, block_expert, w2, w2_scale, *, num_slots, group, tiles, upcast, block_n,
    on_cpu, block_list=None, row_unit=0, out=None,
):  # fmt: skip
    """``moe_stream_down_kernel``: bf16 ``y [num_slots, D]``, each row at its (token, slot)
    (``out``: written into); ``block_list`` and ``row_unit`` as for :func:`launch_gate_up`."""
    inter, dim = h.shape[1], w2.shape[1]
    a_fp8 = h.dtype == torch.float8_e4m3fn
    y = torch.empty((num_slots, dim), dtype=torch.bfloat16, device=h.device) if out is None else out
    w2s = w2_scale.view(torch.uint8)
    num_blocks = (block_expert if block_list is None else block_list).numel()
    moe_stream_down_kernel[_grid(num_blocks, dim // block_n, tiles.group_m)](
        h, hs, w2, w2s, y, row_slot, block_expert,
        block_expert if block_list is None else block_list, num_slots, inter, dim, num_blocks,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0), BLOCK_N=block_n, BLOCK_K=stream_block_k(inter, group, tiles.block_k),
        ROW_UNIT=row_unit,
        **_launch_flags(inter, group, a_fp8, tiles, upcast, on_cpu),
    )  # fmt: skip
    return y


def _grid(num_blocks: int, num_tiles: int, group_m: int) -> tuple[int, ...]:
    """2-D (blocks x tiles) for ``group_m == 0``, else 1-D in ``block_and_tile``'s order."""
    return (num_blocks, num_tiles) if group_m == 0 else (num_blocks * num_tiles,)


def _launch_flags(k, group, a_fp8, tiles, upcast, on_cpu) -> dict:
    return dict(
        A_FP8=a_fp8, GROUP=group or 1, SOFT_ROUND=on_cpu, SWAP_AB=tiles.swap_ab, UPCAST=upcast,
        USE_ASM=tiles.use_asm and not on_cpu, BLOCK_M=tiles.block_m, GROUP_M=tiles.group_m,
        WGMMA_FENCE=tiles.wgmma_fence and not on_cpu,
        KG_P2=triton.next_power_of_2(k // 32), KA_P2=triton.next_power_of_2(k // (group or k)),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def stream_block_k(k: int, group: int | None, wanted: int) -> int:
    """The K step: ``wanted`` if it divides ``k``, else the largest of 256..32 that does."""
    for block_k in (wanted, 256, 128, 64, 32):
        if k % block_k == 0 and block_k >= 32 and (group is None or k % group == 0):
            return block_k
    raise ValueError(f"K={k}: expected a multiple of 32 (and of act_quant_group={group})")
