"""``grouped_linear`` (the attention output projection ``wo_a``: 8 groups of ``[T, 4096] x
[4096, 1024]``, FP8 weights with ue8m0 block scales) on the GPU at the V4-Flash (128 x 128
blocks) and V4.1-Flash (32 x 32 blocks) shapes, per row count: the Triton kernel (the route under
``DEEPINFER_BATCH_INVARIANT=1``, and below ``BF16_ROUTE_TOKENS`` rows) against the bf16 route
(the weight dequantised once per call, then one batched cuBLAS GEMM) and the op's default.

Counted: 2 x T x G x N x K FLOPs (bf16 products; neither route quantises ``x``) against the bf16
dense rate, and the FP8 weight bytes against the copy rate measured in the same run (the decode
rows are weight-bound).

    python -m benchmarks.kernels.bench_grouped_linear --out bench-out/grouped_linear.json
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer.kernels.reference.quant import fp8_block_quant
from deepinfer.kernels_nvidia import grouped_linear as gl

GROUPS, N, K = 8, 1024, 4096
BLOCKS = {"v4-flash": (128, 128), "v41-flash": (32, 32)}
BF16_TFLOPS = 790.0  # the H200's measured bf16 dense rate (see RESULTS.md, Kernels)


def _weight(block: tuple[int, int]):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(GROUPS * N, K, generator=gen) * K**-0.5
    q, scale = fp8_block_quant(w, block)
    return q.cuda(), scale.cuda()


def _triton(x, w, s, block):
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1"
    try:
        return gl.grouped_linear(x, w, s, block_size=block)
    finally:
        os.environ.pop("DEEPINFER_BATCH_INVARIANT")


def _row(model: str, tokens: int, copy_tbs: float) -> dict:
    block = BLOCKS[model]
    w, s = _weight(block)
    x = torch.randn(tokens, GROUPS, K, device="cuda").bfloat16()
    flops = 2 * tokens * GROUPS * N * K
    weight_bytes = w.numel() + s.numel() * s.element_size()
    kernel, route = _triton(x, w, s, block), gl._bf16_route(x, w, s, block, GROUPS, N)
    row = {
        "model": model,
        "T": tokens,
        "max_abs_diff": (kernel.float() - route.float()).abs().max().item(),
    }
    variants = {
        "triton": lambda: _triton(x, w, s, block),
        "bf16_route": lambda: gl._bf16_route(x, w, s, block, GROUPS, N),
        "op": lambda: gl.grouped_linear(x, w, s, block_size=block),
    }
    for name, fn in variants.items():
        ms = time_cuda(fn, iters=30)
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
    row["of_bf16_rate"] = round(row["op_tflops"] / BF16_TFLOPS, 3)
    row["weight_floor_us"] = round(weight_bytes / copy_tbs / 1e6, 1)
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,256,512,1024,4096,8192")
    parser.add_argument("--models", default="v4-flash,v41-flash")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    copy_tbs = copy_bandwidth_tbs()
    rows = [
        _row(model, int(t), copy_tbs)
        for model in args.models.split(",")
        for t in args.tokens.split(",")
    ]
    cols = ["model", "T", "triton_us", "bf16_route_us", "op_us", "triton_tflops",
            "bf16_route_tflops", "op_tflops", "of_bf16_rate", "weight_floor_us", "max_abs_diff"]  # fmt: skip
    print(f"copy rate {copy_tbs:.2f} TB/s; BF16_ROUTE_TOKENS = {gl.BF16_ROUTE_TOKENS}")
    print_table(rows, cols)
    payload = {"env": environment(), "copy_tbs": copy_tbs, "args": vars(args), "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
