"""``fp4_moe_experts``: the routed experts of an MoE layer, as four launches.

1. FP8 quantisation of the expert input per group, once per token (``quant.quantize_rows``; for
   the ``"mx"`` kernels its round trip back to bf16, ``quant.fp8_sim``).
2. Permutation (:func:`align_by_expert`, no host sync; one launch of ``moe_align.align_multi``
   for up to 2,048 pairs, device-side torch ops above): the ``T * k`` (token, slot) pairs sorted by
   expert, each expert's rows padded to whole ``BLOCK_M`` blocks.
3. Gate/up then down grouped GEMMs over the FP4 weights, SwiGLU, router weight and FP8
   re-quantisation fused in the first one's epilogue.
   ``MoeTiles.mma="mx"`` (the default from decode to prefill; ``"fp16-stream"`` opt-in):
   ``moe_stream``'s kernels, one accumulator chained over K; ``"split"`` (decode's down GEMM, and
   with ``fused_gate_up`` decode's gate/up for groups <= 64): ``moe_split``'s even/odd-split
   upcast in the same kernels, ``moe_split_gate_up`` for the fused gate/up. ``"bf16"`` (the
   batch-invariant tiles, and the former prefill default): ``moe_gemm``'s.
   Opt-in (``MoeTiles.mma="fp8"/"fp16"``, FP8 activations only): ``moe_fp8``'s kernels, which
   expand the weights to e4m3 / fp16 for the FP8 / fp16 tensor cores (slower on the H200).
4. ``moe_combine_kernel``: each token's ``k`` expert outputs summed in slot order (fp32).

A row's result depends only on its own token, its expert and the tile shape, never on which
other rows share its block; with ``DEEPINFER_BATCH_INVARIANT=1`` the tile shape is fixed too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from deepinfer.kernels import envs
from deepinfer.kernels_nvidia import moe_align, moe_stream_launch
from deepinfer.kernels_nvidia.moe_align import (  # noqa: F401 (re-exported)
    ExpertLayout,
    _align_by_expert_torch,
    align_by_expert,
)
from deepinfer.kernels_nvidia.moe_fp8 import moe_fp8_down_kernel, moe_fp8_gate_up_kernel
from deepinfer.kernels_nvidia.moe_gemm import (
    moe_combine_kernel,
    moe_down_kernel,
    moe_gate_up_kernel,
)
from deepinfer.kernels_nvidia.moe_split_gate_up import launch_fused_gate_up
from deepinfer.kernels_nvidia.quant import fp8_sim, quantize_rows
from deepinfer.kernels_nvidia.registry import implements


@dataclass(frozen=True)
class MoeTiles:
    """Tile shape and kernel family. ``mma="bf16"``: ``moe_gemm``'s kernels (weights upcast to
    bf16; the only family for ``act_quant_group=None``); ``"fp8"`` / ``"fp16"``: ``moe_fp8``'s
    (weights expanded to e4m3 / fp16 against the FP8 activations, ``swap_ab`` for decode)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pairs: bool = False  # the PAIRS activation layout of moe_gemm (bf16 family only)
    mma: str = "bf16"
    swap_ab: bool = False
    down_block_n: int = 0  # 0: block_n
    use_asm: bool = True  # moe_fp8's inline-PTX nibble expansion (GPU only)
    # row blocks that sweep the column tiles together (L2 reuse; moe_fp8, and moe_stream where
    # 0 means a 2-D grid: axis 0 the row blocks, axis 1 the column tiles)
    group_m: int = 4
    block_k: int = 128  # moe_stream's K step
    # moe_stream: rows padded per expert to block_m / 2 only; block_m-row programs take the
    # expert's block pairs and block_m / 2-row programs its odd last block (a second launch)
    split_tail: bool = False
    # moe_stream: wait for the previous K step's wgmmas before the next upcast (GPU only)
    wgmma_fence: bool = False
    # mma="split": gate and up rows in one weight tile (moe_split_gate_up)
    fused_gate_up: bool = False
    # the down GEMM's own tiles (a moe_stream family, same block_m; None: these)
    down: MoeTiles | None = None


# moe_gemm's bf16-upcast tiles: the prefill / middle defaults before the MXFP4 kernels (kept for
# comparison in bench_moe.py and as the only family the PAIRS layout has).
BF16_TILES = {"decode": MoeTiles(16, 64, 4, 4), "middle": MoeTiles(64, 128, 4, 3),
              "prefill": MoeTiles(128, 128, 8, 2)}  # fmt: skip
# Opt-in (pass ``tiles=``): slower than the bf16 family on the H200
# (benchmarks/results/2026-11-30-h200-moe-v2.json), so not chosen by default. Not fenced against
# the wgmma register hazard (see moe_stream): one real-shape GPU case failed once under 8
# concurrent test workers at 760e1cb and passed three times alone (nondeterministic).
FP8_FAMILY_TILES = {
    "decode": MoeTiles(16, 128, 8, 4, mma="fp16", swap_ab=True),
    "prefill": MoeTiles(128, 64, 8, 2, mma="fp8", down_block_n=128),
}
BATCH_INVARIANT_TILES = MoeTiles(64, 128, 4, 3)
# A decode batch (a few rows per expert): moe_stream's MXFP4 kernels, one accumulator over K.
# Not swap_ab: Triton then splits each K step into 16-deep MMAs that overlap the next upcast.
# H200, 64 tokens (bench_moe.py, 0aa26a9): V4-Flash 2.23 ms, V4.1-Flash 3.85 ms (graph replay);
# 16x128 / K step 128 / 4 warps / 4 stages measured 2.25 / 3.70 ms, the other shapes slower.
# ``wgmma_fence``: without it the down kernel's sm_90 machine code (Triton 3.6) leaves wgmmas in
# flight across the K loop's back-edge while the next upcast overwrites their register operands
# (the race that failed prefill shapes on the H200, see STREAM_TILES); its tests passed, but it
# is not safe by construction, so the decode default waits for every wgmma at each K step.
# Down GEMM: moe_split's even/odd-split upcast, weights on the wgmma's M side (~3.8 SASS
# instructions per weight element in the K loop against ~6.3), every wgmma waited for. H200, 64
# tokens, graph replay (results/2026-11-30-h200-moe-v5-sweep.json, 79032cd): down alone 585 us
# (V4-Flash) and 960 us (V4.1-Flash) against 654 / 1,407 us for the "mx" down; the split gate/up
# (two weight tiles per K step) was slower than "mx" (1,707 vs 1,482 us), so gate/up stays "mx".
SPLIT_DOWN_TILES = MoeTiles(16, 128, 4, 4, mma="split", swap_ab=True, block_k=128, group_m=0,
                            wgmma_fence=True)  # fmt: skip
DECODE_TILES = MoeTiles(16, 128, 8, 3, mma="mx", block_k=256, group_m=0, wgmma_fence=True,
                        down=SPLIT_DOWN_TILES)  # fmt: skip
# Activation groups of up to 64 columns (V4.1-Flash: 32): gate/up with moe_split_gate_up's one
# weight tile of 64 gate + 64 up rows too (its hidden columns must hold whole groups, so V4-Flash's
# 128 would need 256-row tiles, measured slower there). H200, 64 tokens, graph replay
# (results/2026-11-30-h200-moe-v5.json, 0894506): V4.1-Flash 3.06 ms = 1.44 TB/s, against 3.30
# ms for DECODE_TILES and 3.76 ms for the v4 default.
DECODE_TILES_SMALL_GROUP = MoeTiles(16, 64, 4, 4, mma="split", swap_ab=True, block_k=128,
                                    group_m=0, wgmma_fence=True, fused_gate_up=True,
                                    down=SPLIT_DOWN_TILES)  # fmt: skip
# More rows per expert: the same MXFP4 kernels with taller row blocks, programs in grouped order
# (``group_m`` row blocks sweep the column tiles together, so each weight tile is read from HBM
# once for the expert's blocks). (max rows per expert, tiles), first match wins. H200, bench_moe.py
# at 174611d (results/2026-11-30-h200-moe-v4.json), V4-Flash / V4.1-Flash: 8,192 tokens 11.54 /
# 17.38 ms = 214 / 200 TFLOP/s effective (the bf16 moe_gemm default before: 22.5 / 33.2 ms);
# 2,048 tokens 4.68 / 9.10 ms (7.67 / 15.75 before); 512 tokens (V4-Flash) 4.29 ms (7.63 before).
# Only shapes whose sm_90 machine code (Triton 3.6) waits for each wgmma before the next K step
# overwrites its register operands: shapes that leave wgmmas in flight across the loop's back-edge
# (K step 64 at 128 rows, K step 256 at 32 rows, ...) were up to 7% faster but gave wrong rows on
# the H200 (128 x 128, K step 64: 8 GPU test failures at 8,192 tokens).
STREAM_TILES = (
    (24, MoeTiles(32, 128, 8, 4, mma="mx", block_k=128)),
    (96, MoeTiles(64, 128, 8, 3, mma="mx", block_k=128)),
    (float("inf"), MoeTiles(128, 128, 8, 3, mma="mx", block_k=128)),
)
# moe_stream's families: MoeTiles.mma -> its UPCAST ("mx": tl.dot_scaled; "fp16": own unpacking)
STREAM_FAMILIES = {"mx": "mx", "fp16-stream": "fp16", "split": "split"}


def choose_tiles(
    num_slots: int,
    num_experts: int,
    *,
    batch_invariant: bool,
    on_cpu: bool,
    act_quant_group: int | None = None,
) -> MoeTiles:
    """Tiles by rows per expert (decode: a few, prefill: many); batch-invariant mode uses one
    shape (the bf16 family) for every batch size. Otherwise ``moe_stream``'s chained MXFP4
    kernels: for up to 4 rows per expert ``DECODE_TILES`` (``DECODE_TILES_SMALL_GROUP`` for
    ``act_quant_group`` <= 64), then ``STREAM_TILES``."""
    if on_cpu:
        return MoeTiles(16, 64, 4, 1)
    if batch_invariant:
        return BATCH_INVARIANT_TILES
    rows_per_expert = num_slots / num_experts
    if rows_per_expert <= 4:
        small_group = act_quant_group is not None and act_quant_group <= 64
        return DECODE_TILES_SMALL_GROUP if small_group else DECODE_TILES
    return next(tiles for limit, tiles in STREAM_TILES if rows_per_expert <= limit)


def _block_k(k: int, group: int | None) -> int:
    for block_k in (128, 64, 32):
        if k % block_k == 0 and (group is None or (block_k % group == 0)):
            return block_k
    raise ValueError(
        f"K={k} with act_quant_group={group}: expected K a multiple of 32 and of the group"
    )


def _block_n(n: int, wanted: int, group: int | None) -> int:
    for block_n in (wanted, 128, 64, 32, 256):
        if n % block_n == 0 and (group is None or block_n % group == 0):
            return block_n
    raise ValueError(f"intermediate size {n}: expected a multiple of 32 and of the group {group}")


def _check(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, group):
    tokens, dim = x.shape
    experts, two_inter, half_dim = w13.shape
    inter = two_inter // 2
    expected = {
        "topk_weights": (topk_weights, (tokens, topk_ids.shape[1])),
        "w13": (w13, (experts, 2 * inter, dim // 2)),
        "w13_scale": (w13_scale, (experts, 2 * inter, dim // 32)),
        "w2": (w2, (experts, dim, inter // 2)),
        "w2_scale": (w2_scale, (experts, dim, inter // 32)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected [{tokens}, k], got {tuple(topk_ids.shape)}")
    if group is not None and group not in (32, 64, 128):
        raise ValueError(f"act_quant_group={group}: expected 32, 64, 128 or None")
    return tokens, dim, experts, inter


def _quantised_input(x, group, pairs):
    if group is None:
        xq, xs = x.to(torch.bfloat16).contiguous(), x.new_empty((1, 1), dtype=torch.float32)
    else:
        xq, xs = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), group)
    return (to_pairs_layout(xq) if pairs else xq), xs


def to_pairs_layout(a: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` -> each 32-column chunk's 16 even columns, then its 16 odd ones."""
    m, k = a.shape
    raw = a.view(torch.uint8) if a.element_size() == 1 else a
    permuted = raw.view(m, k // 32, 16, 2).transpose(-1, -2).reshape(m, k)
    return permuted.view(a.dtype)


@implements("fp4_moe_experts")
def fp4_moe_experts(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, *, swiglu_limit, act_quant_group
):  # fmt: skip
    return fp4_moe_experts_tiles(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale,
        swiglu_limit=swiglu_limit, act_quant_group=act_quant_group,
    )  # fmt: skip


def fp4_moe_experts_tiles(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, *, swiglu_limit, act_quant_group,
    tiles: MoeTiles | None = None,
):  # fmt: skip
    """:func:`fp4_moe_experts` with an explicit tile shape (``None``: :func:`choose_tiles`)."""
    group = act_quant_group
    tokens, dim, experts, inter = _check(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, group
    )
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    out = torch.empty((tokens, dim), dtype=torch.float32, device=x.device)
    if num_slots == 0:
        return out
    on_cpu = x.device.type == "cpu"
    if tiles is None:
        invariant = envs.batch_invariant()
        tiles = choose_tiles(num_slots, experts, batch_invariant=invariant, on_cpu=on_cpu,
                             act_quant_group=group)  # fmt: skip
    _check_stream_tiles(tiles)
    if tiles.split_tail and (tiles.mma not in STREAM_FAMILIES or tiles.block_m % 32):
        raise ValueError(f"tiles.split_tail: needs mma in {list(STREAM_FAMILIES)} and block_m a "
                         f"multiple of 32, got mma={tiles.mma!r}, block_m={tiles.block_m}")  # fmt: skip
    layout = align_by_expert(
        topk_ids, experts, tiles.block_m // 2 if tiles.split_tail else tiles.block_m
    )
    num_blocks = layout.block_expert.numel()
    if tiles.mma in STREAM_FAMILIES and (group is not None or tiles.mma != "fp16-stream"):
        y = _stream_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group,
                           float(swiglu_limit), tiles, on_cpu)  # fmt: skip
        return _combine(y, out, top_k)
    if tiles.mma in ("fp8", "fp16") and group is not None:
        y = _fp8_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group,
                        float(swiglu_limit), tiles, on_cpu)  # fmt: skip
        return _combine(y, out, top_k)
    xq, xs = _quantised_input(x, group, tiles.pairs)
    fp8 = group is not None
    capacity = layout.row_slot.numel()
    h = torch.empty(
        (capacity, inter), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=x.device
    )
    hs = torch.empty((capacity, inter // group if fp8 else 1), dtype=torch.float32, device=x.device)
    w13s, w2s = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    n1 = _block_n(inter, tiles.block_n, group)
    moe_gate_up_kernel[(num_blocks, inter // n1)](
        xq, xs, w13, w13s, h, hs, layout.row_slot, layout.block_expert, weights,
        num_slots, top_k, dim, inter, float(swiglu_limit),
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1),
        h.stride(0), hs.stride(0),
        A_FP8=fp8, A_GROUP=group or 1, OUT_GROUP=group or 0, SOFT_ROUND=on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=n1, BLOCK_K=_block_k(dim, group), PAIRS=tiles.pairs,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    y = torch.empty((num_slots, dim), dtype=torch.bfloat16, device=x.device)
    n2 = _block_n(dim, tiles.block_n, None)
    moe_down_kernel[(num_blocks, dim // n2)](
        h, hs, w2, w2s, y, layout.row_slot, layout.block_expert, num_slots, inter, dim,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0),
        A_FP8=fp8, A_GROUP=group or 1, SOFT_ROUND=on_cpu,
        BLOCK_M=tiles.block_m, BLOCK_N=n2, BLOCK_K=_block_k(inter, group), PAIRS=tiles.pairs,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return _combine(y, out, top_k)


def _combine(y: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[t] = sum over slots j (in order) of y[t * k + j]`` in fp32."""
    tokens, dim = out.shape
    block = min(1024, triton.next_power_of_2(dim))
    moe_combine_kernel[(tokens, triton.cdiv(dim, block))](y, out, dim, TOP_K=top_k, BLOCK=block)
    return out


def _stream_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group, limit,
                   tiles, on_cpu):  # fmt: skip
    """Gate/up then down with ``moe_stream``'s chained-accumulator kernels (``tiles.mma``:
    ``"mx"`` or ``"fp16-stream"``); returns bf16 ``[T * k, D]`` slot rows."""
    upcast = STREAM_FAMILIES[tiles.mma]
    # "mx": bf16 activations after their FP8 round trip; fp16 upcasts: e4m3 + fp32 scales
    if group is not None and upcast == "fp16":
        act, act_scale = _quantised_input(x, group, False)
    else:
        act, act_scale = _round_trip_bf16(x, group), x.new_empty((1, 1), dtype=torch.float32)
    inter, dim = w13.shape[1] // 2, x.shape[1]
    common = dict(group=group, upcast=upcast, on_cpu=on_cpu)
    gate_up = dict(
        top_k=top_k, limit=limit, block_n=_block_n(inter, tiles.block_n, group), **common
    )
    down_n = _block_n(dim, tiles.down_block_n or tiles.block_n, None)
    down = dict(num_slots=x.shape[0] * top_k, block_n=down_n, **common)
    rows = (layout.row_slot, layout.block_expert)
    if not tiles.split_tail:
        if tiles.fused_gate_up:
            gate_up.pop("upcast")
            h, hs = launch_fused_gate_up(act, topk_weights, *rows, w13, w13_scale, tiles=tiles,
                                         **gate_up)  # fmt: skip
        else:
            h, hs = moe_stream_launch.launch_gate_up(act, act_scale, topk_weights, *rows, w13,
                                                     w13_scale, tiles=tiles, **gate_up)  # fmt: skip
        down_tiles = tiles.down or tiles
        down.update(
            upcast=STREAM_FAMILIES[down_tiles.mma],
            block_n=_block_n(dim, down_tiles.down_block_n or down_tiles.block_n, None),
        )
        return moe_stream_launch.launch_down(h, hs, *rows, w2, w2_scale, tiles=down_tiles, **down)
    pairs, singles = moe_align.split_programs(layout.block_expert, w13.shape[0])
    half = dataclasses.replace(tiles, block_m=layout.block_m)
    launches = ((tiles, pairs), (half, singles))
    h = hs = y = None
    for launch_tiles, block_list in launches:
        h, hs = moe_stream_launch.launch_gate_up(
            act, act_scale, topk_weights, *rows, w13, w13_scale, tiles=launch_tiles,
            block_list=block_list, row_unit=layout.block_m, out=None if h is None else (h, hs),
            **gate_up,
        )  # fmt: skip
    for launch_tiles, block_list in launches:
        y = moe_stream_launch.launch_down(h, hs, *rows, w2, w2_scale, tiles=launch_tiles,
                                   block_list=block_list, row_unit=layout.block_m, out=y,
                                   **down)  # fmt: skip
    return y


def _check_stream_tiles(tiles: MoeTiles) -> None:
    """``fused_gate_up`` needs ``mma="split"``; ``down`` a bf16-activation stream family with
    the same ``block_m``, and neither with ``split_tail``."""
    if tiles.fused_gate_up and (tiles.mma != "split" or tiles.split_tail):
        raise ValueError(f"tiles.fused_gate_up: needs mma='split' and no split_tail, got "
                         f"mma={tiles.mma!r}, split_tail={tiles.split_tail}")  # fmt: skip
    if tiles.down is None:
        return
    down, bf16 = tiles.down, ("mx", "split")
    if (
        tiles.mma not in bf16
        or down.mma not in bf16
        or down.block_m != tiles.block_m
        or (tiles.split_tail or down.split_tail or down.down is not None)
    ):
        raise ValueError(f"tiles.down={down}: expected mma in {bf16} for both, the same block_m "
                         f"({tiles.block_m}), no split_tail and no nested down")  # fmt: skip


def _round_trip_bf16(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """bf16 ``[T, D]``: ``x`` through its FP8 round trip per ``group`` (exact in bf16)."""
    if group is None:
        return x.to(torch.bfloat16).contiguous()
    if x.dtype == torch.bfloat16:
        return fp8_sim(x.contiguous(), group)
    return fp8_sim(x.float().contiguous(), group).to(torch.bfloat16)


def _fp8_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group, limit,
                tiles, on_cpu):  # fmt: skip
    """Gate/up then down with ``moe_fp8``'s kernels; returns bf16 ``[T * k, D]`` slot rows."""
    tokens, dim = x.shape
    inter = w13.shape[1] // 2
    num_slots = tokens * top_k
    _block_k(dim, group), _block_k(inter, group)  # both multiples of the group, or a clear error
    xq, xs = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), group)
    capacity, num_blocks = layout.row_slot.numel(), layout.block_expert.numel()
    n1 = _block_n(inter, tiles.block_n, None)
    fused_quant = n1 % group == 0  # else gate/up stores bf16 and quantize_rows follows
    h = torch.empty((capacity, inter), dtype=torch.float8_e4m3fn if fused_quant else torch.bfloat16,
                    device=x.device)  # fmt: skip
    hs = torch.empty((capacity, inter // group), dtype=torch.float32, device=x.device)
    w13s, w2s = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    weights = topk_weights.float().contiguous().view(-1)
    fp8 = tiles.mma == "fp8"
    flags = dict(GROUP=group, SWAP_AB=tiles.swap_ab, MMA_FP8=fp8,
                 USE_ASM=tiles.use_asm and not on_cpu, SOFT_ROUND=on_cpu, BLOCK_M=tiles.block_m,
                 GROUP_M=tiles.group_m,
                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip
    moe_fp8_gate_up_kernel[(num_blocks * (inter // n1),)](
        xq, xs, w13, w13s, h, hs, layout.row_slot, layout.block_expert, weights,
        num_slots, top_k, dim, inter, limit, num_blocks,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13s.stride(0), w13s.stride(1),
        h.stride(0), hs.stride(0), BLOCK_N=n1, OUT_GROUP=group if fused_quant else 0, **flags,
    )  # fmt: skip
    if not fused_quant:
        h, hs = quantize_rows(h, group)
    y = torch.empty((num_slots, dim), dtype=torch.bfloat16, device=x.device)
    n2 = _block_n(dim, tiles.down_block_n or tiles.block_n, None)
    moe_fp8_down_kernel[(num_blocks * (dim // n2),)](
        h, hs, w2, w2s, y, layout.row_slot, layout.block_expert, num_slots, inter, dim, num_blocks,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0), BLOCK_N=n2, **flags,
    )  # fmt: skip
    return y
