"""FP8 x FP8 block-scaled GEMM on the GPU at the V4-Flash (128x128 blocks) and V4.1-Flash
(32x32 blocks) linear shapes: the Triton kernel (default tiles, batch-invariant tiles, and a few
alternative prefill tiles) vs ``torch._scaled_mm`` with per-tensor scales (the best torch
built-in for FP8 GEMM; it does less work: no block scales) vs the reference (dequantise + fp32
matmul).

Prefill (M >= 4096) reports TFLOP/s against the measured ``_scaled_mm`` rate of the same run
(the FP8 ceiling); decode (M <= 64) reports weight bytes streamed in TB/s against the copy rate.

    python benchmarks/kernels/bench_gemm.py --out bench-out/gemm.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_tbs, environment, print_table, time_cuda, time_graph, write_json  # noqa: E402

from deepinfer.kernels import OPS  # noqa: E402
from deepinfer.kernels.reference import quant as ref_quant  # noqa: E402
from deepinfer.kernels.testing.cases.gemm import random_fp8_weight  # noqa: E402
from deepinfer.kernels_nvidia import gemm  # noqa: E402

DEVICE = "cuda"  # the benchmarks time CUDA kernels; a CPU smoke run may override it


# (model, N, K, block): wq_a, wq_b, wkv, wo_b, shared w1/w3, shared w2
SHAPES = [
    ("V4-Flash", 1024, 4096, (128, 128)), ("V4-Flash", 32768, 1024, (128, 128)),
    ("V4-Flash", 512, 4096, (128, 128)), ("V4-Flash", 4096, 8192, (128, 128)),
    ("V4-Flash", 2048, 4096, (128, 128)), ("V4-Flash", 4096, 2048, (128, 128)),
    ("V4.1-Flash", 1280, 5120, (32, 32)), ("V4.1-Flash", 32768, 1280, (32, 32)),
    ("V4.1-Flash", 2304, 5120, (32, 32)), ("V4.1-Flash", 5120, 2304, (32, 32)),
]  # fmt: skip
SWEEP = [gemm.GemmTiles(128, 128, 8, 8, 3), gemm.GemmTiles(128, 256, 8, 8, 3),
         gemm.GemmTiles(128, 128, 8, 4, 4), gemm.GemmTiles(64, 256, 8, 4, 4)]  # fmt: skip


def _inputs(m, n, k, block):
    gen = torch.Generator().manual_seed(m * 7 + n)
    w, ws = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    a, sa = ref_quant.fp8_act_quant(torch.randn(m, k, device=DEVICE), block[1])
    return a, sa, w, ws


def _time(row, name, fn, flops, nbytes, iters=50, graph=False):
    try:
        ms = time_graph(fn, iters=iters) if graph else time_cuda(fn, warmup=3, iters=iters)
    except Exception as e:  # one failing variant must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        return
    row[f"{name}_us"] = ms * 1e3
    row[f"{name}_TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    row[f"{name}_TB/s"] = nbytes / (ms * 1e-3) / 1e12


def bench_shape(model, n, k, block, m, sweep):
    a, sa, w, ws = _inputs(m, n, k, block)
    flops, nbytes = 2 * m * n * k, n * k + m * k + 2 * m * n
    row = {"model": model, "M": m, "N": n, "K": k, "block": block[0]}
    kw = dict(out_dtype=torch.bfloat16)
    invariant = gemm.choose_tiles(m, n, k, batch_invariant=True, on_cpu=False)
    _time(row, "triton", lambda: gemm.fp8_gemm_nt_tiles(a, sa, w, ws, block, **kw), flops, nbytes)
    _time(row, "triton_bi", lambda: gemm.fp8_gemm_nt_tiles(a, sa, w, ws, block, tiles=invariant, **kw),
          flops, nbytes)  # fmt: skip
    one = torch.ones((), device=DEVICE)
    _time(row, "scaled_mm", lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
          out_dtype=torch.bfloat16), flops, nbytes)  # fmt: skip
    if m <= 64:  # decode: device time without launch overhead (as under the engine's graphs)
        triton_fn = lambda: gemm.fp8_gemm_nt_tiles(a, sa, w, ws, block, **kw)  # noqa: E731
        _time(row, "triton_graph", triton_fn, flops, nbytes, graph=True)
        _time(row, "scaled_mm_graph", lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
              out_dtype=torch.bfloat16), flops, nbytes, graph=True)  # fmt: skip
    ref = OPS["fp8_gemm_nt"].reference
    _time(row, "reference", lambda: ref(a, sa, w, ws, block), flops, nbytes, iters=5)
    for i, tiles in enumerate(sweep):
        _time(row, f"sweep{i}", lambda t=tiles: gemm.fp8_gemm_nt_tiles(a, sa, w, ws, block, tiles=t, **kw),
              flops, nbytes)  # fmt: skip
    if "triton_us" in row and "scaled_mm_us" in row:
        row["vs_scaled_mm"] = row["scaled_mm_us"] / row["triton_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--ms", default="1,64,4096")
    parser.add_argument("--sweep-shapes", type=int, default=2, help="prefill shapes to tile-sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = []
    for i, (model, n, k, block) in enumerate(SHAPES):
        for m in map(int, args.ms.split(",")):
            sweep = SWEEP if m >= 4096 and i % 6 < args.sweep_shapes else []
            rows.append(bench_shape(model, n, k, block, m, sweep))
            write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
            print(
                {key: (round(v, 3) if isinstance(v, float) else v) for key, v in rows[-1].items()}
            )
    cols = ["model", "M", "N", "K", "triton_us", "triton_TFLOP/s", "triton_TB/s", "triton_bi_us",
            "triton_graph_us", "triton_graph_TB/s", "scaled_mm_us", "scaled_mm_TFLOP/s",
            "scaled_mm_graph_us", "vs_scaled_mm", "reference_us"]  # fmt: skip
    print_table(rows, cols)


if __name__ == "__main__":
    main()
