"""FP8 x FP8 block-scaled GEMM on the GPU at the V4-Flash (128x128 blocks) and V4.1-Flash
(32x32 blocks) linear shapes: the op (``op``: its default plan, which for V4 blocks at prefill M
is cuBLAS's blockwise GEMM, see ``gemm/cublas.py``; ``op_m_major``: the op given M-major activation
scales, as ``linear`` passes them on that route; ``tiles``: the Triton prefill tiles; ``triton_bi``:
the batch-invariant tiles) vs
torch's blockwise-scaled built-in (``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` x
``BlockWise128x128``: the same math, V4 blocks only; torch has no 1x32 recipe on SM90), vs
``torch._scaled_mm`` with per-tensor scales (less work: no block scales; the FP8 ceiling) vs the
reference (dequantise + fp32 matmul).

Prefill (M >= 4096) reports TFLOP/s eager and from a one-call CUDA graph (device time: eager
timing of the shorter products includes the host's launch cost), plus a few alternative tile
configurations and, for V4.1, the parts of the bf16 route. Decode (M <= 64) reports weight+scale bytes streamed in TB/s next
to the measured copy rate, eager and from a CUDA graph replaying one call on each of many
copies of the weight (distinct buffers, more bytes than L2): the kernel's streaming rate with
the launch cost taken out.

The LM head section (``--head-ms``) times ``linear``'s fp32-activation x bf16-weight product at
the vocabulary shapes against the reference (fp32 copy of the weight + fp32 GEMM).

    python -m benchmarks.kernels.bench_gemm --out bench-out/gemm.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer.kernels import OPS
from deepinfer.kernels.reference import quant as ref_quant
from deepinfer.kernels.testing.cases.gemm import random_fp8_weight
from deepinfer.kernels_nvidia.gemm import bf16 as gemm_bf16
from deepinfer.kernels_nvidia.gemm import cublas as gemm_cublas
from deepinfer.kernels_nvidia.gemm import ops as gemm

DEVICE = "cuda"
T = gemm.GemmTiles
# (model, N, K, block): wq_a, wq_b, wkv, wo_b, shared w1/w3, shared w2
SHAPES = [
    ("V4-Flash", 1024, 4096, (128, 128)), ("V4-Flash", 32768, 1024, (128, 128)),
    ("V4-Flash", 512, 4096, (128, 128)), ("V4-Flash", 4096, 8192, (128, 128)),
    ("V4-Flash", 2048, 4096, (128, 128)), ("V4-Flash", 4096, 2048, (128, 128)),
    ("V4.1-Flash", 1280, 5120, (32, 32)), ("V4.1-Flash", 32768, 1280, (32, 32)),
    ("V4.1-Flash", 2304, 5120, (32, 32)), ("V4.1-Flash", 5120, 2304, (32, 32)),
]  # fmt: skip
SWEEP_V4 = {
    "ptr_s4": T(64, 128, 8, 4, 4), "ptr_s3": T(64, 128, 8, 4, 3), "ptr_s2": T(64, 128, 8, 4, 2),
    "tma_s4": T(64, 128, 8, 4, 4, use_tma=True), "tma_s3": T(64, 128, 8, 4, 3, use_tma=True),
    "tma128_s3": T(128, 128, 8, 8, 3, use_tma=True),
}  # fmt: skip
SWEEP_V41 = {"fp8_tiles": gemm.UNIFORM_TILES, "fp8_tiles_s3": T(64, 128, 8, 4, 3)}
WARM_ONLY = False  # --warm-shape: call each variant once (fills Triton's cache), time nothing
GRAPH_BYTES = 256 * 2**20  # weight copies per decode graph: at least this many bytes (L2 is 50 MB)


def _inputs(m, n, k, block):
    gen = torch.Generator().manual_seed(m * 7 + n)
    w, ws = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    a, sa = ref_quant.fp8_act_quant(torch.randn(m, k, device=DEVICE), block[1])
    return a, sa, w, ws


def torch_blockwise(a, sa, w, ws):
    """torch's blockwise-scaled FP8 GEMM: ``a_scale`` M-major ``[M, K/128]``, the weight's
    scales as fp32 ``[K/128, N/128]`` (K-block-major)."""
    from torch.nn.functional import ScalingType, scaled_mm

    m, kb = sa.shape
    sa_m_major = torch.empty_strided((m, kb), (1, m), dtype=torch.float32, device=sa.device)
    sa_m_major.copy_(sa)
    sb = torch.exp2(ws.view(torch.uint8).float() - 127).contiguous().t()
    return functools.partial(
        scaled_mm, a, w.t(), sa_m_major, ScalingType.BlockWise1x128, sb,
        ScalingType.BlockWise128x128, output_dtype=torch.bfloat16,
    )  # fmt: skip


def _scaled_mm_tensor(a, w):
    one = torch.ones((), device=DEVICE)
    return functools.partial(
        torch._scaled_mm, a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
    )


def _record(row, name, us, flops, nbytes):
    row[f"{name}_us"] = us
    row[f"{name}_TFLOP/s"] = flops / us / 1e6
    row[f"{name}_TB/s"] = nbytes / us / 1e6


def _time(row, name, fn, flops, nbytes, *, want=None, iters=30):
    if WARM_ONLY:
        return _warm(row, name, fn)
    try:
        if want is not None:
            row[f"{name}_rel_err"] = ((fn().float() - want).abs().max() / want.abs().max()).item()
        _record(row, name, time_cuda(fn, warmup=3, iters=iters) * 1e3, flops, nbytes)
    except Exception as e:  # one failing variant must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]


def _graph_us(fns):
    """Median us per call: one CUDA graph holding one call of each of ``fns`` (distinct weights),
    replayed between device events (the L2 flushed before each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_cuda(graph.replay, warmup=3, iters=20) * 1e3 / len(fns)


def _warm(row, name, fn):
    try:
        fn()
    except Exception as e:
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]


def _time_graph(row, name, fns, flops, nbytes):
    if WARM_ONLY:
        return _warm(row, f"{name}_graph", fns[0])
    try:
        _record(row, f"{name}_graph", _graph_us(fns), flops, nbytes)
    except Exception as e:
        row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:300]


def bench_prefill(model, n, k, block, m):
    a, sa, w, ws = _inputs(m, n, k, block)
    flops, nbytes = 2 * m * n * k, n * k + m * k + 2 * m * n
    row = {"model": model, "M": m, "N": n, "K": k, "block": block[0]}
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, ws, block, out_dtype=torch.float32)
    call = functools.partial(gemm.fp8_gemm_nt_tiles, a, sa, w, ws, block, out_dtype=torch.bfloat16)
    row["plan"] = str(gemm.choose_plan(m, n, k, min(block), torch.bfloat16, batch_invariant=False,
                                       on_cpu=False,
                                       cublas=gemm_cublas.recipe_fits(n, k, block[1], block)))  # fmt: skip
    op = functools.partial(gemm.fp8_gemm_nt, a, sa, w, ws, block)
    _time(row, "op", op, flops, nbytes, want=want)
    _time_graph(row, "op", [op], flops, nbytes)
    # the op as ``linear`` calls it: activation scales written M-major by the quantisation
    sa_m = torch.empty_strided(sa.shape, (1, sa.shape[0]), dtype=sa.dtype, device=sa.device)
    sa_m.copy_(sa)
    op_m = functools.partial(gemm.fp8_gemm_nt, a, sa_m, w, ws, block)
    _time(row, "op_m_major", op_m, flops, nbytes, want=want)
    _time_graph(row, "op_m_major", [op_m], flops, nbytes)
    tiles = gemm.choose_plan(m, n, k, min(block), torch.bfloat16, batch_invariant=False,
                             on_cpu=False).tiles  # fmt: skip
    _time(row, "tiles", functools.partial(call, tiles=tiles), flops, nbytes, want=want)
    bi = functools.partial(call, tiles=gemm.UNIFORM_TILES)
    _time(row, "triton_bi", bi, flops, nbytes)
    _time_graph(row, "triton_bi", [bi], flops, nbytes)
    if block == (128, 128):
        _time(row, "torch_blockwise", torch_blockwise(a, sa, w, ws), flops, nbytes, want=want)
        _time_graph(row, "torch_blockwise", [torch_blockwise(a, sa, w, ws)], flops, nbytes)
        sweep = SWEEP_V4
    else:
        sweep = SWEEP_V41
        a16 = gemm_bf16.dequantize_to_bf16(a, sa, (1, block[1]))
        b16 = gemm_bf16.dequantize_to_bf16(w, ws.view(torch.uint8), block)
        _time(row, "bf16_mm_only", functools.partial(torch.mm, a16, b16.t()), flops, nbytes)
        fn = functools.partial(gemm_bf16.dequantize_to_bf16, a, sa, (1, block[1]))
        _time(row, "dequant_a", fn, flops, 3 * m * k)
        fn = functools.partial(gemm_bf16.dequantize_to_bf16, w, ws.view(torch.uint8), block)
        _time(row, "dequant_b", fn, flops, 3 * n * k)
    _time(row, "scaled_mm", _scaled_mm_tensor(a, w), flops, nbytes)
    ref = functools.partial(OPS["fp8_gemm_nt"].reference, a, sa, w, ws, block)
    _time(row, "reference", ref, flops, nbytes, iters=3)
    for name, tiles in sweep.items():
        fn = functools.partial(call, tiles=tiles)
        _time(row, f"sweep_{name}", fn, flops, nbytes, want=want)
        _time_graph(row, f"sweep_{name}", [fn], flops, nbytes)
    return row


def bench_decode(model, n, k, block, m):
    a, sa, w, ws = _inputs(m, n, k, block)
    flops, nbytes = 2 * m * n * k, n * k + ws.numel()  # weight + scale bytes
    row = {"model": model, "M": m, "N": n, "K": k, "block": block[0]}
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, ws, block, out_dtype=torch.float32)
    copies = max(4, min(64, -(-GRAPH_BYTES // (n * k))))
    weights = [(w.clone(), ws.clone()) for _ in range(copies)]
    row["copies"] = copies
    row["plan"] = str(gemm.choose_plan(m, n, k, min(block), torch.bfloat16, batch_invariant=False,
                                       on_cpu=False,
                                       cublas=gemm_cublas.recipe_fits(n, k, block[1], block)))  # fmt: skip
    triton = [functools.partial(gemm.fp8_gemm_nt, a, sa, wi, si, block) for wi, si in weights]
    _time(row, "triton", triton[0], flops, nbytes, want=want)
    _time_graph(row, "triton", triton, flops, nbytes)
    bi = [functools.partial(gemm.fp8_gemm_nt_tiles, a, sa, wi, si, block, out_dtype=torch.bfloat16,
                            tiles=gemm.UNIFORM_TILES) for wi, si in weights]  # fmt: skip
    _time_graph(row, "triton_bi", bi, flops, nbytes)
    if block == (128, 128):
        try:
            fns = [torch_blockwise(a, sa, wi, si) for wi, si in weights]
        except Exception as e:
            row["torch_blockwise_error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            _time(row, "torch_blockwise", fns[0], flops, nbytes, want=want)
            _time_graph(row, "torch_blockwise", fns, flops, nbytes)
    _time_graph(row, "scaled_mm", [_scaled_mm_tensor(a, wi) for wi, _ in weights], flops, nbytes)
    return row


HEAD_SHAPES = [("V4-Flash", 129280, 4096), ("V4.1-Flash", 129280, 5120)]  # vocab x hidden


def bench_head(model, n, k, m):
    """The LM head's fp32 x bf16 -> fp32 product: ``linear``'s kernel (bf16 weight read once,
    activations split into three bf16 parts) vs the reference (an fp32 copy of the weight, then
    an fp32 GEMM); bytes: the bf16 weight."""
    gen = torch.Generator().manual_seed(n + m)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16().to(DEVICE)
    flops, nbytes = 2 * m * n * k, 2 * n * k
    row = {"model": model, "M": m, "N": n, "K": k}
    want = OPS["linear"].reference(x, w, out_dtype=torch.float32)
    op = functools.partial(gemm.linear, x, w, out_dtype=torch.float32)
    _time(row, "op", op, flops, nbytes, want=want)
    _time_graph(row, "op", [op], flops, nbytes)
    ref = functools.partial(OPS["linear"].reference, x, w, out_dtype=torch.float32)
    _time(row, "reference", ref, flops, nbytes)
    w32 = w.float()
    _time(row, "fp32_mm_only", functools.partial(torch.mm, x, w32.t()), flops, nbytes)
    del w32
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--decode-ms", default="1,8,16,32,64")
    parser.add_argument("--prefill-ms", default="4096")
    parser.add_argument("--head-ms", default="1,64", help="LM head rows (fp32 x bf16)")
    parser.add_argument("--warm-shape", type=int, default=None, help="compile for SHAPES[i] only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm.py needs an NVIDIA GPU")
    if args.warm_shape is not None:
        global WARM_ONLY
        WARM_ONLY = True
        shapes = [SHAPES[args.warm_shape]]
        for ms, bench in ((args.decode_ms, bench_decode), (args.prefill_ms, bench_prefill)):
            for model, n, k, block in shapes:
                for m in map(int, ms.split(",")) if ms else ():
                    row = bench(model, n, k, block, m)
                    print({key: v for key, v in row.items() if "error" in key} or "", end="")
        torch.cuda.synchronize()
        return
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    payload = {"env": environment(), "copy_TB/s": ceiling, "decode": [], "prefill": [], "head": []}
    for model, n, k in HEAD_SHAPES:
        for m in map(int, args.head_ms.split(",")) if args.head_ms else ():
            payload["head"].append(bench_head(model, n, k, m))
            write_json(args.out, payload)
    for section, ms, bench in (("decode", args.decode_ms, bench_decode),
                               ("prefill", args.prefill_ms, bench_prefill)):  # fmt: skip
        for model, n, k, block in SHAPES:
            for m in map(int, ms.split(",")) if ms else ():
                payload[section].append(bench(model, n, k, block, m))
                write_json(args.out, payload)
                errors = {key: v for key, v in payload[section][-1].items() if "error" in key}
                if errors:
                    print(model, m, n, k, errors)
    print_table(payload["decode"], ["model", "M", "N", "K", "triton_us", "triton_graph_us",
                "triton_graph_TB/s", "triton_bi_graph_TB/s", "torch_blockwise_graph_TB/s",
                "scaled_mm_graph_TB/s", "triton_rel_err"])  # fmt: skip
    print_table(payload["head"], ["model", "M", "N", "K", "op_us", "op_graph_us", "op_graph_TB/s",
                "reference_us", "fp32_mm_only_us", "op_rel_err"])  # fmt: skip
    print_table(payload["prefill"], ["model", "M", "N", "K", "op_TFLOP/s", "tiles_TFLOP/s",
                "op_graph_TFLOP/s", "op_m_major_graph_TFLOP/s", "triton_bi_graph_TFLOP/s",
                "torch_blockwise_TFLOP/s",
                "torch_blockwise_graph_TFLOP/s", "scaled_mm_TFLOP/s", "bf16_mm_only_TFLOP/s",
                "op_rel_err", "tiles_rel_err", "reference_us"])  # fmt: skip
    sweep = sorted({key for r in payload["prefill"] for key in r
                    if key.endswith("graph_TFLOP/s") and key.startswith("sweep_")})  # fmt: skip
    print_table(payload["prefill"], ["model", "N", "K", *sweep])


if __name__ == "__main__":
    main()
