"""FP8 activation quantisation per token-group on the GPU: the Triton kernel vs the reference
(plain torch ops, which is also the best torch built-in composition for this math) at the
V4-Flash (hidden 4096, group 128) and V4.1-Flash (hidden 5120, group 32) shapes.

Bytes counted: read x (bf16) once, write q (1 B per element) and one fp32 scale per group. The
ceiling is the device copy rate measured in the same run (bytes read + written).

    python -m benchmarks.kernels.bench_quant --out bench-out/quant.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import (
    copy_bandwidth_tbs,
    environment,
    print_table,
    time_cuda,
    time_graph,
    write_json,
)
from deepinfer.kernels import OPS
from deepinfer.kernels_nvidia import quant

DEVICE = "cuda"  # the benchmarks time CUDA kernels; a CPU smoke run may override it


SHAPES = [("V4-Flash", 4096, 128), ("V4.1-Flash", 5120, 32)]


def bench_shape(model: str, hidden: int, group: int, tokens: int, ceiling: float) -> dict:
    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    nbytes = tokens * hidden * (2 + 1) + tokens * hidden // group * 4
    row = {"model": model, "tokens": tokens, "hidden": hidden, "group": group}
    impls = {
        "triton": (lambda: quant.fp8_act_quant(x, group), 100),
        "reference": (lambda: OPS["fp8_act_quant"].reference(x, group), 20),
    }
    for name, (fn, iters) in impls.items():
        ms = time_cuda(fn, iters=iters)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_TB/s"] = nbytes / (ms * 1e-3) / 1e12
    if tokens <= 64:  # decode: device time without launch overhead
        ms = time_graph(lambda: quant.fp8_act_quant(x, group))
        row["triton_graph_us"] = ms * 1e3
    row["triton_%ceiling"] = 100 * row["triton_TB/s"] / ceiling
    row["speedup_vs_torch"] = row["reference_us"] / row["triton_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="1,64,4096,16384")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = []
    for model, hidden, group in SHAPES:
        for tokens in map(int, args.tokens.split(",")):
            rows.append(bench_shape(model, hidden, group, tokens, ceiling))
            write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
    cols = ["model", "tokens", "group", "triton_us", "triton_graph_us", "triton_TB/s", "triton_%ceiling",
            "reference_us", "reference_TB/s", "speedup_vs_torch"]  # fmt: skip
    print_table(rows, cols)


if __name__ == "__main__":
    main()
