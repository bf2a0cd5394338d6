"""FP8 x FP8 block-scaled GEMM (``fp8_gemm_nt``) and the FP8-weight path of ``linear``, in Triton.

``c[m, n] = sum_k a[m, k] sa[m, k // ga] * b[n, k] sb[n // bn, k // bk]``. Three kernels, picked
by :func:`choose_plan`:

- ``tiles`` (:mod:`.tiles`): output tiles, one FP8 tensor-core dot per scale sub-block,
  promoted into fp32 with its scales. Large tiles for prefill-sized M, smaller ones in between.
- ``stream`` (:mod:`.stream`): decode-sized M (<= 64): split-N over many programs, plus a
  split-K chosen from (N, K) whose fp32 partials are summed in a fixed order.
- ``bf16`` (:mod:`.bf16`): 32-column scale blocks (V4.1) at large M with a bf16 output:
  both operands dequantised to bf16 (exact) and one bf16 GEMM, which beats promoting an FP8
  accumulator every 32 columns.
- ``cublas`` (:mod:`.cublas`): V4's 1 x 128 / 128 x 128 recipe at prefill-sized M with a
  bf16 output on Hopper: cuBLAS's blockwise-scaled FP8 GEMM through torch, 1.1-1.9x the
  Triton tiles' rate there; a shape cuBLAS refuses runs the tiles.

``DEEPINFER_BATCH_INVARIANT=1`` uses one ``tiles`` configuration for every M, so a row's result
does not depend on the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.kernels import OPS, envs
from deepinfer.kernels_nvidia.gemm import cublas as gemm_cublas
from deepinfer.kernels_nvidia.gemm.bf16 import fp8_gemm_via_bf16
from deepinfer.kernels_nvidia.gemm.dense import linear_f32_bf16, matmul_invariant
from deepinfer.kernels_nvidia.gemm.stream import MAX_M as STREAM_MAX_M
from deepinfer.kernels_nvidia.gemm.stream import StreamTiles, fp8_gemm_stream
from deepinfer.kernels_nvidia.gemm.tiles import (
    GemmTiles,
    fp8_gemm_tiled,
    tma_compatible,
)
from deepinfer.kernels_nvidia.quant import quantize_rows
from deepinfer.kernels_nvidia.registry import implements

__all__ = [
    "GemmPlan",
    "GemmTiles",
    "StreamTiles",
    "choose_plan",
    "fp8_gemm_nt",
    "linear",
    "linears",
]

# 64 x 128 tiles, 4 warps, 4 stages: two programs per SM, whose promotions overlap each other's
# tensor-core work; the best pointer-load configuration at every V4 shape swept
# (``sweep_gemm.py``). TMA descriptor loads won only at K = 8192. Batch-invariant mode uses the
# pointer configuration for every M.
UNIFORM_TILES = GemmTiles(64, 128, 8, 4, 4)
PREFILL_TILES = UNIFORM_TILES
PREFILL_TMA_TILES = GemmTiles(64, 128, 8, 4, 4, use_tma=True)
PREFILL_TMA_MIN_K = 8192
PREFILL_MIN_M = 1024
# Decode (CUDA-graph replay): the stream kernel wins at M <= 16 everywhere and at M = 64 for
# 32-column scales; with 128-column scales at M = 64 the 64 x 128 tiles win at most shapes (the
# stream kernel re-reads a 64-row activation tile per 64 weight rows).
STREAM_MAX_M_COARSE = 32
# The stream kernel quantises its own activation rows up to this M: each of its programs then
# re-quantises every row, work that grows with M while the launch it saves does not (batch 1-16
# decode is where launches dominate; wider once measured on a GPU)
QUANTISING_STREAM_MAX_M = 16
logger = logging.getLogger(__name__)
# Whether the stream kernel's in-kernel activation quantisation compiled (it is switched off for
# the process, with a warning, if the GPU's compiler refuses it; the two-launch path then runs)
_QUANTISING_STREAM = {"ok": True}
BF16_MIN_M = 1024
CPU_TILES = GemmTiles(32, 64, 8, 4, 1)  # the interpreter: few big programs


@dataclass(frozen=True)
class GemmPlan:
    """Which kernel runs a product: ``kind`` in ``tiles`` | ``stream`` | ``bf16`` | ``cublas``, and
    its tiles."""

    kind: str
    tiles: GemmTiles | StreamTiles | None = None


def choose_plan(
    m: int, n: int, k: int, sub_k: int, out_dtype: torch.dtype, *, batch_invariant: bool,
    on_cpu: bool, cublas: bool = False,
) -> GemmPlan:  # fmt: skip
    """The kernel for an ``m x n x k`` product whose scales change every ``sub_k`` columns.

    Batch-invariant mode (and the CPU interpreter) always takes one ``tiles`` configuration;
    otherwise M picks the kernel: ``stream`` up to 64 rows (32 with 128-column scales), ``bf16``
    for 32-column scales from ``BF16_MIN_M`` rows (bf16 output only), ``cublas`` from
    ``gemm_cublas.MIN_M`` rows with a bf16 output where ``cublas`` says the device and the
    scale recipe allow it, prefill tiles from ``PREFILL_MIN_M`` rows (TMA loads from
    ``K = PREFILL_TMA_MIN_K``).
    """
    if on_cpu:
        return GemmPlan("tiles", CPU_TILES)
    if batch_invariant:
        return GemmPlan("tiles", UNIFORM_TILES)
    if m <= (STREAM_MAX_M if sub_k < 128 else STREAM_MAX_M_COARSE):
        return GemmPlan("stream", StreamTiles())
    if cublas and m >= gemm_cublas.MIN_M and out_dtype == torch.bfloat16:
        return GemmPlan("cublas")
    if sub_k < 128 and m >= BF16_MIN_M and out_dtype == torch.bfloat16 and k % 128 == 0:
        return GemmPlan("bf16")
    if m < PREFILL_MIN_M:
        return GemmPlan("tiles", UNIFORM_TILES)
    return GemmPlan("tiles", PREFILL_TMA_TILES if k >= PREFILL_TMA_MIN_K else PREFILL_TILES)


def _check_operands(a, a_scale, b, b_scale, block_size):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}: expected [M, K] and [N, K]")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a, b dtypes {a.dtype}, {b.dtype}: expected float8_e4m3fn")
    m, k = a.shape
    n = b.shape[0]
    if a_scale.shape[0] != m or a_scale.shape[1] == 0 or k % a_scale.shape[1]:
        raise ValueError(f"a_scale {tuple(a_scale.shape)}: expected [{m}, K / g] dividing K={k}")
    bn, bk = block_size
    want = (-(-n // bn), -(-k // bk))
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale {tuple(b_scale.shape)}: expected {want} for block {block_size}")
    a_group = k // a_scale.shape[1]
    sub_k = min(a_group, bk)
    if sub_k < 16 or k % sub_k:
        raise ValueError(f"scale blocks a_group={a_group}, bk={bk}: expected >= 16 dividing K={k}")
    return m, n, k, a_group, sub_k


def default_plan(m, n, k, a_group, sub_k, block_size, out_dtype, device) -> GemmPlan:
    """:func:`choose_plan` for this device and the batch-invariant switch."""
    on_cpu = device.type == "cpu"
    cublas = (
        not on_cpu
        and gemm_cublas.recipe_fits(n, k, a_group, block_size)
        and gemm_cublas.available(device.index or 0)
    )
    return choose_plan(
        m, n, k, sub_k, out_dtype, batch_invariant=envs.batch_invariant(), on_cpu=on_cpu,
        cublas=cublas,
    )  # fmt: skip


@implements("fp8_gemm_nt")
def fp8_gemm_nt(a, a_scale, b, b_scale, block_size, *, out_dtype=torch.bfloat16):
    return fp8_gemm_nt_plan(a, a_scale, b, b_scale, block_size, out_dtype=out_dtype)


def fp8_gemm_nt_plan(a, a_scale, b, b_scale, block_size, *, out_dtype, plan=None):
    """:func:`fp8_gemm_nt` with an explicit plan (``None``: :func:`choose_plan`)."""
    m, n, k, a_group, sub_k = _check_operands(a, a_scale, b, b_scale, block_size)
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    a_scale = a_scale.float()
    weight_scale, b_scale = b_scale, b_scale.view(torch.uint8)  # (cuBLAS: the caller's object)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if plan is None:
        plan = default_plan(m, n, k, a_group, sub_k, block_size, out_dtype, a.device)
    if plan.kind == "cublas":
        c = gemm_cublas.fp8_gemm_cublas(a, a_scale, b, weight_scale)
        if c is not None:
            return c
        plan = GemmPlan("tiles", PREFILL_TMA_TILES if k >= PREFILL_TMA_MIN_K else PREFILL_TILES)
        a_scale = a_scale.contiguous()  # (linear wrote it M-major for cuBLAS)
    if plan.kind == "stream":
        a_scale = a_scale.contiguous()
        return fp8_gemm_stream(
            a, a_scale, b, b_scale, block_size, a_group, sub_k, out_dtype, plan.tiles
        )
    if plan.kind == "bf16":
        return fp8_gemm_via_bf16(a, a_scale, b, b_scale, block_size, a_group).to(out_dtype)
    tiles = plan.tiles
    if tiles.use_tma and not tma_compatible(a, b):
        tiles = GemmTiles(tiles.block_m, tiles.block_n, tiles.group_m, tiles.num_warps,
                          tiles.num_stages, tiles.block_k)  # fmt: skip
    return fp8_gemm_tiled(a, a_scale, b, b_scale, block_size, a_group, sub_k, tiles, out_dtype)


def fp8_gemm_nt_tiles(a, a_scale, b, b_scale, block_size, *, out_dtype, tiles):
    """:func:`fp8_gemm_nt` through one given kernel configuration: ``GemmTiles`` (tiles),
    ``StreamTiles`` (stream), ``None`` (bf16) or ``"cublas"``."""
    if tiles == "cublas":
        plan = GemmPlan("cublas")
    else:
        kind = {GemmTiles: "tiles", StreamTiles: "stream", type(None): "bf16"}[type(tiles)]
        plan = GemmPlan(kind, tiles)
    return fp8_gemm_nt_plan(a, a_scale, b, b_scale, block_size, out_dtype=out_dtype, plan=plan)


@implements("linear")
def linear(
    x, weight, scale=None, *, block_size=None, act_quant_group=None, out_dtype=None
):  # fmt: skip
    """FP8 block weights with FP8 activation quantisation run the Triton GEMM; fp32 activations
    times bf16 weights with an fp32 result (the LM head, the MoE router) run
    :func:`.dense.linear_f32_bf16`; every other weight format (dense, FP4, FP8 without
    activation quantisation) runs the reference, its product through the fixed-tile
    :func:`.dense.matmul_invariant` under ``DEEPINFER_BATCH_INVARIANT=1``."""
    if _is_f32_bf16(x, weight, scale, act_quant_group, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        return linear_f32_bf16(x2, w).view(*x.shape[:-1], weight.shape[0])
    if not _is_fp8_path(x, weight, scale, act_quant_group):
        if envs.batch_invariant() and x.device.type == "cuda":
            return _linear_invariant(x, weight, scale, block_size, act_quant_group, out_dtype)
        return OPS["linear"].reference(
            x, weight, scale, block_size=block_size, act_quant_group=act_quant_group,
            out_dtype=out_dtype,
        )  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    (m, k), n, bk = x2.shape, weight.shape[0], tuple(block_size)[1]
    out_dtype = out_dtype or x.dtype
    plan = default_plan(m, n, k, act_quant_group, min(act_quant_group, bk), tuple(block_size),
                        out_dtype, x.device)  # fmt: skip
    if _quantises_in_kernel(plan, m, act_quant_group, bk):
        y = _stream_quantising(x2, weight, scale, tuple(block_size), act_quant_group, out_dtype,
                               plan)  # fmt: skip
        if y is not None:
            return y.view(*x.shape[:-1], n)
    xq, xs = quantize_rows(x2, act_quant_group, m_major=plan.kind == "cublas")
    y = fp8_gemm_nt_plan(xq, xs, weight, scale, tuple(block_size), out_dtype=out_dtype, plan=plan)
    return y.view(*x.shape[:-1], n)


@implements("linears")
def linears(
    x, weights, scales, *, block_size=None, act_quant_group=None, out_dtype=None
):  # fmt: skip
    """:func:`linear` for each weight, the FP8 activation quantisation of ``x`` shared by the
    FP8-path weights whose plans read the same scale layout (the rest call :func:`linear`)."""
    if len(weights) != len(scales):
        raise ValueError(f"{len(weights)} weights, {len(scales)} scales: expected one scale each")
    kw = {"block_size": block_size, "act_quant_group": act_quant_group, "out_dtype": out_dtype}
    shared = [_is_fp8_path(x, w, s, act_quant_group) for w, s in zip(weights, scales, strict=True)]
    if sum(shared) < 2:
        return tuple(linear(x, w, s, **kw) for w, s in zip(weights, scales, strict=True))
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    (m, k), bk = x2.shape, tuple(block_size)[1]
    dtype = out_dtype or x.dtype
    plans = [
        default_plan(m, w.shape[0], k, act_quant_group, min(act_quant_group, bk),
                     tuple(block_size), dtype, x.device) if use else None
        for w, use in zip(weights, shared, strict=True)
    ]  # fmt: skip
    m_major = {p.kind == "cublas" for p in plans if p is not None}
    fused = [p is not None and _quantises_in_kernel(p, m, act_quant_group, bk) for p in plans]
    if len(m_major) > 1 or all(u == f for u, f in zip(shared, fused, strict=True)):
        # the plans read the scales in two layouts, or each FP8 product quantises its own
        # activation in its kernel (decode): each weight on its own
        return tuple(linear(x, w, s, **kw) for w, s in zip(weights, scales, strict=True))
    xq, xs = quantize_rows(x2, act_quant_group, m_major=m_major.pop())
    out = []
    for w, s, plan in zip(weights, scales, plans, strict=True):
        if plan is None:
            out.append(linear(x, w, s, **kw))
            continue
        y = fp8_gemm_nt_plan(xq, xs, w, s, tuple(block_size), out_dtype=dtype, plan=plan)
        out.append(y.view(*x.shape[:-1], w.shape[0]))
    return tuple(out)


def _quantises_in_kernel(plan: GemmPlan, m: int, act_quant_group: int, bk: int) -> bool:
    """Whether the product runs the stream kernel quantising its activation itself (one
    launch less than :func:`.quant.quantize_rows` then the product): up to
    :data:`QUANTISING_STREAM_MAX_M` rows, one activation scale per scale sub-block of K."""
    return (
        _QUANTISING_STREAM["ok"]
        and plan.kind == "stream"
        and 0 < m <= QUANTISING_STREAM_MAX_M
        and act_quant_group <= bk
    )


def _stream_quantising(x2, weight, scale, block_size, act_quant_group, out_dtype, plan):
    """``linear``'s FP8 product through the stream kernel on the unquantised rows ``x2``;
    ``None`` if the kernel does not compile here (then never tried again)."""
    m, k = x2.shape
    a = torch.empty((m, k), dtype=torch.float8_e4m3fn, device="meta")  # shapes checked as the
    a_scale = torch.empty((m, k // act_quant_group), device="meta")  # quantised operands'
    _check_operands(a, a_scale, weight, scale, block_size)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    try:
        return fp8_gemm_stream(
            x2, None, weight, scale.view(torch.uint8), block_size, act_quant_group,
            act_quant_group, out_dtype, plan.tiles,
        )  # fmt: skip
    except Exception as error:  # a compiler's refusal (Triton raises several types)
        if not _on_gpu(x2):  # the interpreter compiles nothing: an error there is a bug
            raise
        _QUANTISING_STREAM["ok"] = False
        logger.warning(
            "the stream GEMM quantising its own rows did not compile on this GPU (%s: %s); "
            "decode products quantise first, one launch more each",
            type(error).__name__, error,
        )  # fmt: skip
        return None


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _is_fp8_path(x, weight, scale, act_quant_group) -> bool:
    return (
        weight.dtype == torch.float8_e4m3fn
        and scale is not None
        and act_quant_group is not None
        and x.shape[-1] % act_quant_group == 0
        and act_quant_group in (16, 32, 64, 128, 256)
    )


def _linear_invariant(x, weight, scale, block_size, act_quant_group, out_dtype):
    """The reference ``linear`` of the other weight formats (dense, FP4, FP8 without activation
    quantisation), its products through :func:`.dense.matmul_invariant`."""
    from deepinfer.kernels.reference.linear import linear_operands

    xc, wc = linear_operands(x, weight, scale, block_size, act_quant_group)
    y = matmul_invariant(xc.reshape(-1, xc.shape[-1]), wc)
    return y.view(*x.shape[:-1], wc.shape[0]).to(out_dtype or x.dtype)


def _is_f32_bf16(x, weight, scale, act_quant_group, out_dtype) -> bool:
    return (
        scale is None
        and act_quant_group is None
        and x.dtype == torch.float32
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and (out_dtype or x.dtype) == torch.float32
        and x.shape[-1] == weight.shape[1]
    )
