"""Compressor softmax pooling on the GPU for an 8k-token prompt: V4 ratio 4 overlapped (8-row
windows, 512 and 128 wide) and ratio 128, V4.1 ratios 2 and 1; fp32 inputs as the reference
promotes them. Triton vs the reference (torch softmax + sum).

Bytes counted: kv and score read once, the entries written once. Ceiling: the copy rate
measured in the same run.

    python -m benchmarks.kernels.bench_compressor --out bench-out/compressor.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer import kernels
from deepinfer.kernels_nvidia import backend

TOKENS = 8192
SHAPES = [  # (name, ratio, window rows, width)
    ("v4 csa", 4, 8, 512),
    ("v4 csa indexer", 4, 8, 128),
    ("v4 hca", 128, 128, 512),
    ("v4.1 r2", 2, 2, 512),
    ("v4.1 r1", 1, 1, 512),
]


def bench(name: str, ratio: int, window: int, width: int, ceiling: float) -> dict:
    entries = TOKENS // ratio
    kv = torch.randn(entries, window, width, device="cuda")
    score = torch.randn(entries, window, width, device="cuda")
    nbytes = 2 * kv.numel() * 4 + entries * width * 4
    ms = time_cuda(lambda: backend.ops["compress_pool"](kv, score), iters=50)
    ref_ms = time_cuda(lambda: kernels.OPS["compress_pool"].reference(kv, score), iters=50)
    return {"case": f"{name} E={entries} L={window} d={width}", "triton_us": ms * 1e3,
            "triton_TB/s": nbytes / ms / 1e9, "%ceiling": 100 * nbytes / ms / 1e9 / ceiling,
            "reference_us": ref_ms * 1e3, "reference_TB/s": nbytes / ref_ms / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_compressor.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = [bench(*shape, ceiling) for shape in SHAPES]
    cols = ["case", "triton_us", "triton_TB/s", "%ceiling", "reference_us", "reference_TB/s"]
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
