"""Exploration sweep for the FP8 block GEMM on the H200: tile-kernel variants at prefill
M, the bf16 route for 32-column blocks, streaming-kernel variants at decode M (eager and
CUDA-graph replay of many kernels on distinct weights), and torch's blockwise-scaled built-in.

Compilation is the slow part, so it runs first in parallel worker processes that fill Triton's
disk cache (``--phase warm --part i --parts P``); the timing phase then runs alone on the GPU:

    for i in $(seq 0 11); do
        python -m benchmarks.kernels.sweep_gemm --phase warm --part $i --parts 12 &
    done; wait
    python -m benchmarks.kernels.sweep_gemm --phase time --out sweep.json
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, time_cuda, write_json
from deepinfer.kernels import OPS
from deepinfer.kernels.reference import quant as ref_quant
from deepinfer.kernels.testing.cases.gemm import random_fp8_weight
from deepinfer.kernels_nvidia.gemm import bf16 as gemm_bf16
from deepinfer.kernels_nvidia.gemm import ops as gemm
from deepinfer.kernels_nvidia.gemm.ops import GemmTiles as T
from deepinfer.kernels_nvidia.gemm.ops import StreamTiles as S

V4 = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048)]
V41 = [(1280, 5120), (32768, 1280), (2304, 5120), (5120, 2304)]
PREFILL_V4 = {
    "t64x128w4s4": T(64, 128, 8, 4, 4),
    "t64x128w4s5": T(64, 128, 8, 4, 5),
    "t64x128w4s3k256": T(64, 128, 8, 4, 3, block_k=256),
    "t128x64w4s4": T(128, 64, 8, 4, 4),
    "t128x128w8s3": T(128, 128, 8, 8, 3),
    "t128x128w8s4": T(128, 128, 8, 8, 4),
    "t128x128w8s5": T(128, 128, 8, 8, 5),
    "t128x128w8s3k256": T(128, 128, 8, 8, 3, block_k=256),
    "t128x256w8s3": T(128, 256, 8, 8, 3),
    "t128x128w8s4g16": T(128, 128, 16, 8, 4),
    "t128x128w8s4ask": T(128, 128, 8, 8, 4, a_scale_k_major=True),
    "tma64x128w4s4": T(64, 128, 8, 4, 4, use_tma=True),
    "tma128x128w8s4": T(128, 128, 8, 8, 4, use_tma=True),
    "tma128x128w8s5": T(128, 128, 8, 8, 5, use_tma=True),
    "tmaP1_128x128w8s4": T(128, 128, 8, 8, 4, use_tma=True, programs_per_sm=1),
    "tmaP1F_128x128w8s4": T(128, 128, 8, 8, 4, use_tma=True, programs_per_sm=1, flatten=True),
    "tmaP2_64x128w4s4": T(64, 128, 8, 4, 4, use_tma=True, programs_per_sm=2),
    "tmaP3F_64x128w4s4": T(64, 128, 8, 4, 4, use_tma=True, programs_per_sm=3, flatten=True),
}
PREFILL_V41 = {
    "t64x128w4s4": T(64, 128, 8, 4, 4),
    "t128x128w8s3": T(128, 128, 8, 8, 3),
    "t128x32w4s4": T(128, 32, 8, 4, 4),
    "t64x32w4s4": T(64, 32, 8, 4, 4),
    "bf16": None,
}
STREAM = {
    "s64w4s4": S(64, 128, 4, 4, 264),
    "s64w4s3t528": S(64, 128, 4, 3, 528),
    "s128w4s4": S(128, 128, 4, 4, 264),
    "s64w4s3k256": S(64, 256, 4, 3, 264),
    "s32w4s4": S(32, 128, 4, 4, 264),
}
DECODE_MS = (1, 16, 64)
PREFILL_M = 4096
DEVICE = "cuda"  # a CPU smoke run (interpreter) may override it


def _inputs(m, n, k, block, seed=0):
    gen = torch.Generator().manual_seed(seed + m * 7 + n)
    w, ws = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    a, sa = ref_quant.fp8_act_quant(torch.randn(m, k, device=DEVICE), block[1])
    return a, sa, w, ws


def _jobs():
    """(name, model, m, n, k, block, tiles) in a fixed order shared by both phases."""
    jobs = []
    for name, t in PREFILL_V4.items():
        jobs += [(name, "V4", PREFILL_M, n, k, (128, 128), t) for n, k in V4]
    for name, t in PREFILL_V41.items():
        jobs += [(name, "V4.1", PREFILL_M, n, k, (32, 32), t) for n, k in V41]
    for name, t in STREAM.items():
        for m in DECODE_MS:
            jobs += [(name, "V4", m, n, k, (128, 128), t) for n, k in V4]
            jobs += [(name, "V4.1", m, n, k, (32, 32), t) for n, k in V41]
    return jobs


def _call(a, sa, w, ws, block, tiles):
    return gemm.fp8_gemm_nt_tiles(a, sa, w, ws, block, out_dtype=torch.bfloat16, tiles=tiles)


def warm(part: int, parts: int) -> None:
    units = sorted({(j[0], j[1], j[2]) for j in _jobs()})  # one compile (or two) per unit
    mine = {u for i, u in enumerate(units) if i % parts == part}
    for name, model, m, n, k, block, tiles in _jobs():
        if (name, model, m) in mine:
            try:
                _call(*_inputs(m, n, k, block), block, tiles)
            except Exception as e:  # the time phase records it
                print(f"warm {name} {model}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()


def _rel_err(got, want):
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def _graph_rate(fns):
    """Median us per call of ``fns`` (one call each, distinct weights) replayed from one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return time_cuda(graph.replay, warmup=3, iters=20) * 1e3 / len(fns)


def _torch_blockwise(a, sa, w, ws):
    """torch's blockwise-scaled FP8 GEMM (1x128 activations, 128x128 weights), or None."""
    from torch.nn.functional import ScalingType, scaled_mm

    sa_mmajor = sa.t().contiguous().t()
    sb = torch.exp2(ws.view(torch.uint8).float() - 127).contiguous().t()  # [K/128, N/128]
    return lambda: scaled_mm(
        a, w.t(), sa_mmajor, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )  # fmt: skip


def _torch_blockwise_legacy(a, sa, w, ws):
    sa_mmajor = sa.t().contiguous().t()
    sb = torch.exp2(ws.view(torch.uint8).float() - 127).contiguous().t()
    return lambda: torch._scaled_mm(a, w.t(), sa_mmajor, sb, out_dtype=torch.bfloat16)


def _time_into(row, key, fn, flops, nbytes, want=None):
    try:
        out = fn()
        if want is not None:
            row[f"{key}_err"] = _rel_err(out, want)
        us = time_cuda(fn, warmup=2, iters=15) * 1e3
    except Exception as e:
        row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    row[f"{key}_us"] = us
    row[f"{key}_TFLOP/s"] = flops / us / 1e6
    row[f"{key}_TB/s"] = nbytes / us / 1e6


def _prefill_row(model, n, k, block, variants):
    a, sa, w, ws = _inputs(PREFILL_M, n, k, block)
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, ws, block, out_dtype=torch.float32)
    flops, nbytes = 2 * PREFILL_M * n * k, n * k + PREFILL_M * k + 2 * PREFILL_M * n
    row = {"model": model, "M": PREFILL_M, "N": n, "K": k}
    for name, tiles in variants.items():
        fn = functools.partial(_call, a, sa, w, ws, block, tiles)
        _time_into(row, name, fn, flops, nbytes, want)
    one = torch.ones((), device=DEVICE)
    fn = functools.partial(
        torch._scaled_mm, a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
    )
    _time_into(row, "scaled_mm_tensor", fn, flops, nbytes)
    if block == (128, 128):
        for name, make in (("torch_blockwise", _torch_blockwise),
                           ("torch_blockwise_legacy", _torch_blockwise_legacy)):  # fmt: skip
            try:
                fn = make(a, sa, w, ws)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            _time_into(row, name, fn, flops, nbytes, want)
        return row
    a16 = gemm_bf16.dequantize_to_bf16(a, sa, (1, block[1]))
    b16 = gemm_bf16.dequantize_to_bf16(w, ws.view(torch.uint8), block)
    _time_into(row, "bf16_mm_only", functools.partial(torch.mm, a16, b16.t()), flops, nbytes)
    fn = functools.partial(gemm_bf16.dequantize_to_bf16, a, sa, (1, block[1]))
    _time_into(row, "dequant_a", fn, flops, nbytes)
    fn = functools.partial(gemm_bf16.dequantize_to_bf16, w, ws.view(torch.uint8), block)
    _time_into(row, "dequant_b", fn, flops, nbytes)
    return row


def prefill_rows(log):
    for model, shapes, variants, block in (
        ("V4", V4, PREFILL_V4, (128, 128)), ("V4.1", V41, PREFILL_V41, (32, 32))
    ):  # fmt: skip
        for n, k in shapes:
            log(_prefill_row(model, n, k, block, variants))


def _graph_into(row, key, fns, wbytes, want=None):
    try:
        if want is not None:
            row[f"{key}_err"] = _rel_err(fns[0](), want)
        us = _graph_rate(fns)
    except Exception as e:
        row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    row[f"{key}_graph_us"] = us
    row[f"{key}_graph_TB/s"] = wbytes / us / 1e6


def _decode_row(model, m, n, k, block):
    copies = max(4, min(64, -(-256 * 2**20 // (n * k))))
    a, sa, w, ws = _inputs(m, n, k, block)
    weights = [(w.clone(), ws.clone()) for _ in range(copies)]
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, ws, block, out_dtype=torch.float32)
    wbytes = n * k + ws.numel()
    row = {"model": model, "M": m, "N": n, "K": k, "copies": copies}
    for name, tiles in STREAM.items():
        fns = [functools.partial(_call, a, sa, wi, si, block, tiles) for wi, si in weights]
        _graph_into(row, name, fns, wbytes, want)
    first = next(iter(STREAM.values()))
    _time_into(row, "eager", functools.partial(_call, a, sa, w, ws, block, first), 1, wbytes)
    one = torch.ones((), device=DEVICE)
    fns = [
        functools.partial(torch._scaled_mm, a, wi.t(), scale_a=one, scale_b=one,
                          out_dtype=torch.bfloat16)
        for wi, _ in weights
    ]  # fmt: skip
    _graph_into(row, "scaled_mm_tensor", fns, wbytes)
    if block == (128, 128):
        try:
            fns = [_torch_blockwise(a, sa, wi, si) for wi, si in weights]
        except Exception as e:
            row["torch_blockwise_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            _graph_into(row, "torch_blockwise", fns, wbytes, want)
    return row


def decode_rows(log):
    for model, shapes, block in (("V4", V4, (128, 128)), ("V4.1", V41, (32, 32))):
        for n, k in shapes:
            for m in DECODE_MS:
                log(_decode_row(model, m, n, k, block))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("warm", "time"), required=True)
    parser.add_argument("--part", type=int, default=0)
    parser.add_argument("--parts", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default="prefill,decode")
    args = parser.parse_args()
    if args.phase == "warm":
        start = time.time()
        warm(args.part, args.parts)
        print(f"warm part {args.part}: {time.time() - start:.1f} s")
        return
    payload = {"env": environment(), "copy_TB/s": copy_bandwidth_tbs(), "prefill": [], "decode": []}
    print(f"copy {payload['copy_TB/s']:.2f} TB/s")

    def log_to(section):
        def log(row):
            payload[section].append(row)
            write_json(args.out, payload)
            short = {
                key.replace("_TFLOP/s", "").replace("_graph_TB/s", ""): round(v, 3 if v < 10 else 0)
                for key, v in row.items()
                if key.endswith(("TFLOP/s", "graph_TB/s")) or key in ("M", "N", "K")
            }
            errs = {key: v[:90] for key, v in row.items() if key.endswith("_error")}
            bad = {key: round(v, 4) for key, v in row.items() if key.endswith("_err") and v > 0.02}
            print(row["model"], short, errs or "", bad or "", flush=True)

        return log

    if "prefill" in args.sections:
        prefill_rows(log_to("prefill"))
    if "decode" in args.sections:
        decode_rows(log_to("decode"))


if __name__ == "__main__":
    main()
