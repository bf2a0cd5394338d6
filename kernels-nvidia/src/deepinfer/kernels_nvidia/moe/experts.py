"""``fp4_moe_experts``: the routed experts of an MoE layer, as four launches.

1. The expert input through its FP8 round trip per group, once per token (``quant.fp8_sim``;
   the ``"bf16"`` kernels take the e4m3 rows and scales of ``quant.quantize_rows`` instead).
2. Permutation (:func:`align.align_by_expert`, no host sync): the ``T * k`` (token, slot) pairs
   sorted by expert, each expert's rows padded to whole ``BLOCK_M`` blocks.
3. Gate/up then down grouped GEMMs over the FP4 weights, SwiGLU, router weight and FP8
   re-quantisation fused in the first one's epilogue, in one of three kernel families
   (``MoeTiles.mma``): ``"mx"`` (``stream``'s chained accumulator with ``tl.dot_scaled``, the
   default from decode to prefill), ``"split"`` (``split``'s even/odd upcast: decode's down GEMM,
   and decode's gate/up for activation groups of up to 64 columns) and ``"bf16"`` (``bf16``'s
   per-block upcast: the batch-invariant tiles and the CPU path).
4. ``moe_combine_kernel``: each token's ``k`` expert outputs summed in slot order (fp32).

A row's result depends only on its own token, its expert and the tile shape, never on which
other rows share its block; with ``DEEPINFER_BATCH_INVARIANT=1`` the tile shape is fixed too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from deepinfer.kernels import envs
from deepinfer.kernels_nvidia.moe import stream
from deepinfer.kernels_nvidia.moe.align import align_by_expert
from deepinfer.kernels_nvidia.moe.bf16 import bf16_experts
from deepinfer.kernels_nvidia.moe.common import moe_combine_kernel
from deepinfer.kernels_nvidia.moe.split import launch_fused_gate_up
from deepinfer.kernels_nvidia.quant import fp8_sim
from deepinfer.kernels_nvidia.registry import implements

FAMILIES = ("mx", "split", "bf16")
STREAM_FAMILIES = ("mx", "split")  # the chained-accumulator kernels of ``stream``


@dataclass(frozen=True)
class MoeTiles:
    """Tile shape and kernel family (``mma``: one of :data:`FAMILIES`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    mma: str = "bf16"
    # the weight rows on the MMA's M side and the few tokens on its N side (stream families)
    swap_ab: bool = False
    down_block_n: int = 0  # the down GEMM's block_n in the stream families (0: block_n)
    # stream families: row blocks that sweep the column tiles together (L2 reuse); 0 means a 2-D
    # grid (axis 0 the row blocks, axis 1 the column tiles)
    group_m: int = 4
    block_k: int = 128  # the stream families' K step
    # stream families: wait for the previous K step's wgmmas before the next upcast (GPU only)
    wgmma_fence: bool = False
    # mma="split": gate and up rows in one weight tile
    fused_gate_up: bool = False
    # the down GEMM's own tiles (a stream family, same block_m; None: these)
    down: MoeTiles | None = None


BATCH_INVARIANT_TILES = MoeTiles(64, 128, 4, 3)
# A decode batch (a few rows per expert): "mx" gate/up, one accumulator over K; not swap_ab,
# since Triton then splits each K step into 16-deep MMAs that overlap the next upcast. The
# fence is there because this shape's down kernel left wgmmas in flight across the K loop: its
# tests passed, but it was not safe by construction. The down GEMM takes the split upcast with
# the weights on the wgmma's M side, which needs fewer instructions per weight element; as two
# weight tiles the split gate/up lost to "mx".
SPLIT_DOWN_TILES = MoeTiles(16, 128, 4, 4, mma="split", swap_ab=True, block_k=128, group_m=0,
                            wgmma_fence=True)  # fmt: skip
DECODE_TILES = MoeTiles(16, 128, 8, 3, mma="mx", block_k=256, group_m=0, wgmma_fence=True,
                        down=SPLIT_DOWN_TILES)  # fmt: skip
# Activation groups of up to 64 columns (V4.1-Flash: 32): the split gate/up as one weight tile of
# 64 gate + 64 up rows, which beat DECODE_TILES there. Its hidden columns must hold whole
# groups, so V4-Flash's 128 would need 256-row tiles, which measured slower.
DECODE_TILES_SMALL_GROUP = MoeTiles(16, 64, 4, 4, mma="split", swap_ab=True, block_k=128,
                                    group_m=0, wgmma_fence=True, fused_gate_up=True,
                                    down=SPLIT_DOWN_TILES)  # fmt: skip
# More rows per expert: the same "mx" kernels with taller row blocks, programs in grouped order
# (``group_m`` row blocks sweep the column tiles together, so each weight tile is read from HBM
# once for the expert's blocks). (max rows per expert, tiles), first match wins. Only shapes
# whose sm_90 code (Triton 3.6) waits for each wgmma before the next K step overwrites its
# register operands: the faster shapes that leave wgmmas in flight gave wrong rows on the H200.
STREAM_TILES = (
    (24, MoeTiles(32, 128, 8, 4, mma="mx", block_k=128)),
    (96, MoeTiles(64, 128, 8, 3, mma="mx", block_k=128)),
    (float("inf"), MoeTiles(128, 128, 8, 3, mma="mx", block_k=128)),
)


def choose_tiles(
    num_slots: int,
    num_experts: int,
    *,
    batch_invariant: bool,
    on_cpu: bool,
    act_quant_group: int | None = None,
) -> MoeTiles:
    """Tiles by rows per expert (decode: a few, prefill: many); batch-invariant mode uses one
    shape (the bf16 family) for every batch size. Otherwise the stream families: for up to 4
    rows per expert ``DECODE_TILES`` (``DECODE_TILES_SMALL_GROUP`` for ``act_quant_group`` <=
    64), then ``STREAM_TILES``."""
    if on_cpu:
        return MoeTiles(16, 64, 4, 1)
    if batch_invariant:
        return BATCH_INVARIANT_TILES
    rows_per_expert = num_slots / num_experts
    if rows_per_expert <= 4:
        small_group = act_quant_group is not None and act_quant_group <= 64
        return DECODE_TILES_SMALL_GROUP if small_group else DECODE_TILES
    return next(tiles for limit, tiles in STREAM_TILES if rows_per_expert <= limit)


def block_n_for(n: int, wanted: int, group: int | None) -> int:
    """The GEMM's column tile: ``wanted`` if it divides ``n`` (and holds whole groups)."""
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


@implements("fp4_moe_experts")
def fp4_moe_experts(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, *, swiglu_limit, act_quant_group,
    shared=None, out_dtype=torch.float32,
):  # fmt: skip
    return fp4_moe_experts_tiles(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale,
        swiglu_limit=swiglu_limit, act_quant_group=act_quant_group, shared=shared,
        out_dtype=out_dtype,
    )  # fmt: skip


def fp4_moe_experts_tiles(
    x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, *, swiglu_limit, act_quant_group,
    shared=None, out_dtype=torch.float32, tiles: MoeTiles | None = None,
):  # fmt: skip
    """:func:`fp4_moe_experts` with an explicit tile shape (``None``: :func:`choose_tiles`)."""
    group = act_quant_group
    tokens, dim, experts, inter = _check(
        x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale, group
    )
    if shared is not None and tuple(shared.shape) != (tokens, dim):
        raise ValueError(f"shared: expected shape {(tokens, dim)}, got {tuple(shared.shape)}")
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    combined = out_dtype in (torch.float32, torch.bfloat16)  # else rounded after the combine
    out = torch.empty((tokens, dim), dtype=out_dtype if combined else torch.float32,
                      device=x.device)  # fmt: skip
    if num_slots == 0:
        return out.to(out_dtype)
    on_cpu = x.device.type == "cpu"
    if tiles is None:
        invariant = envs.batch_invariant()
        tiles = choose_tiles(num_slots, experts, batch_invariant=invariant, on_cpu=on_cpu,
                             act_quant_group=group)  # fmt: skip
    _check_tiles(tiles)
    layout = align_by_expert(topk_ids, experts, tiles.block_m)
    if tiles.mma in STREAM_FAMILIES:
        y = _stream_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group,
                           float(swiglu_limit), tiles, on_cpu)  # fmt: skip
    else:
        y = bf16_experts(
            x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k=top_k, group=group,
            limit=float(swiglu_limit), tiles=tiles, on_cpu=on_cpu,
            block_n_gate_up=block_n_for(inter, tiles.block_n, group),
            block_n_down=block_n_for(dim, tiles.block_n, None),
        )  # fmt: skip
    return _combine(y, out, top_k, shared).to(out_dtype)


def _combine(y: torch.Tensor, out: torch.Tensor, top_k: int, shared=None) -> torch.Tensor:
    """``out[t] = sum over slots j (in order) of y[t * k + j]`` in fp32, plus ``shared[t]``,
    stored in ``out``'s dtype."""
    tokens, dim = out.shape
    block = min(1024, triton.next_power_of_2(dim))
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    moe_combine_kernel[(tokens, triton.cdiv(dim, block))](
        y, y if shared is None else shared, out, dim, 0 if shared is None else shared.stride(0),
        TOP_K=top_k, BLOCK=block, SHARED=shared is not None,
        SOFT_ROUND=out.device.type == "cpu",
    )  # fmt: skip
    return out


def _stream_family(x, topk_weights, layout, w13, w13_scale, w2, w2_scale, top_k, group, limit,
                   tiles, on_cpu):  # fmt: skip
    """Gate/up then down with ``stream``'s chained-accumulator kernels (the fused gate/up of
    ``split`` where ``tiles.fused_gate_up``); returns bf16 ``[T * k, D]`` slot rows."""
    act = round_trip_bf16(x, group)
    inter, dim = w13.shape[1] // 2, x.shape[1]
    rows = (layout.row_slot, layout.block_expert)
    gate_up = dict(top_k=top_k, group=group, limit=limit, tiles=tiles, on_cpu=on_cpu,
                   block_n=block_n_for(inter, tiles.block_n, group))  # fmt: skip
    if tiles.fused_gate_up:
        h = launch_fused_gate_up(act, topk_weights, *rows, w13, w13_scale, **gate_up)
    else:
        h = stream.launch_gate_up(act, topk_weights, *rows, w13, w13_scale, **gate_up)
    down_tiles = tiles.down or tiles
    block_n = block_n_for(dim, down_tiles.down_block_n or down_tiles.block_n, None)
    return stream.launch_down(h, *rows, w2, w2_scale, num_slots=x.shape[0] * top_k, group=group,
                              tiles=down_tiles, block_n=block_n, on_cpu=on_cpu)  # fmt: skip


def _check_tiles(tiles: MoeTiles) -> None:
    """``mma`` one of :data:`FAMILIES`; ``fused_gate_up`` needs ``mma="split"``; ``down`` a
    stream family with the same ``block_m``, under a stream family, and no nested ``down``."""
    if tiles.mma not in FAMILIES:
        raise ValueError(f"tiles.mma={tiles.mma!r}: expected one of {FAMILIES}")
    if tiles.fused_gate_up and tiles.mma != "split":
        raise ValueError(f"tiles.fused_gate_up: needs mma='split', got mma={tiles.mma!r}")
    if tiles.down is None:
        return
    down = tiles.down
    if (
        tiles.mma not in STREAM_FAMILIES
        or down.mma not in STREAM_FAMILIES
        or down.block_m != tiles.block_m
        or down.down is not None
    ):
        raise ValueError(f"tiles.down={down}: expected mma in {STREAM_FAMILIES} for both, the "
                         f"same block_m ({tiles.block_m}) and no nested down")  # fmt: skip


def round_trip_bf16(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """bf16 ``[T, D]``: ``x`` through its FP8 round trip per ``group`` (exact in bf16)."""
    if group is None:
        return x.to(torch.bfloat16).contiguous()
    if x.dtype == torch.bfloat16:
        return fp8_sim(x.contiguous(), group)
    return fp8_sim(x.float().contiguous(), group).to(torch.bfloat16)
