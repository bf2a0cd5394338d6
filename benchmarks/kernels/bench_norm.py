"""RMSNorm (plain and fused residual-add) on the GPU: Triton kernels vs the reference vs
torch's built-in ``torch.nn.functional.rms_norm``, at V4-Flash (4096) and V4.1/Pro-like (5120)
hidden sizes, 1 to 16k tokens, bf16.

Bytes counted: rms_norm reads x and writes y (2 x T x H x 2 B); the fused op reads x and the
residual and writes y and the new residual (4 x T x H x 2 B); the weight is negligible. The
ceiling is the device copy rate measured in the same run (bytes read + written).

    python -m benchmarks.kernels.bench_norm --out bench-out/norm.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer import kernels
from deepinfer.kernels_nvidia import backend


def bench_shape(hidden: int, tokens: int, ceiling: float) -> list[dict]:
    w = torch.randn(hidden, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    plain = {
        "triton": lambda: backend.ops["rms_norm"](x, w, 1e-6),
        "reference": lambda: kernels.OPS["rms_norm"].reference(x, w, 1e-6),
        "torch": lambda: torch.nn.functional.rms_norm(x, (hidden,), w.bfloat16(), 1e-6),
    }
    fused = {
        "triton": lambda: backend.ops["fused_add_rms_norm"](x, r, w, 1e-6),
        "reference": lambda: kernels.OPS["fused_add_rms_norm"].reference(x, r, w, 1e-6),
        "torch": lambda: torch.nn.functional.rms_norm(x + r, (hidden,), w.bfloat16(), 1e-6),
    }
    rows = []
    for op, impls, passes in (("rms_norm", plain, 2), ("fused_add_rms_norm", fused, 4)):
        nbytes = passes * tokens * hidden * 2
        row = {"op": op, "hidden": hidden, "tokens": tokens}
        for name, fn in impls.items():
            ms = time_cuda(fn)
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_TB/s"] = nbytes / (ms * 1e-3) / 1e12
        row["triton_%ceiling"] = 100 * row["triton_TB/s"] / ceiling
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="1,16,256,4096,16384")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_norm.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = []
    for hidden in (4096, 5120):
        for tokens in map(int, args.tokens.split(",")):
            rows += bench_shape(hidden, tokens, ceiling)
    cols = ["op", "hidden", "tokens", "triton_us", "triton_TB/s", "triton_%ceiling",
            "torch_us", "torch_TB/s", "reference_us"]  # fmt: skip
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
