"""Cache writes in the model's row formats on the GPU: the Triton ``pack_rows``, the fused
pack-and-scatter into cache rows, and the torch compositions they replace (the reference
``pack_rows``, and it followed by ``index_copy_``: the engine's write today), at decode (64 rows)
and prefill (8,192 rows) for each format the models store (V4 and V4.1-Flash widths).

Bytes counted: the bf16 rows read once and the packed rows written once (plus the 8-byte row
numbers of a scatter). The ceiling is the device copy rate measured in the same run.

    python -m benchmarks.kernels.bench_cache_rows --out bench-out/cache_rows.json
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
from deepinfer.kernels import OPS, RowFormat
from deepinfer.kernels_nvidia import cache_rows

DEVICE = "cuda"

# (model, cache kind, format): the formats of engine.model.cache.storage_formats at Flash widths
FORMATS = [
    ("V4-Flash", "window/kv", RowFormat(512, 448, "e4m3", 64, "ue8m0")),
    ("V4-Flash", "index_keys", RowFormat(128, 128, "e2m1", 32, "ue8m0")),
    ("V4.1-Flash", "window", RowFormat(512, 512, "e4m3", 32, "ue8m0")),
    ("V4.1-Flash", "kv", RowFormat(512, 512, "e2m1", 16, "e4m3")),
    ("V4.1-Flash", "index_keys", RowFormat(128, 128, "e2m1", 32, "ue8m0")),
]
CACHE_ROWS = 1 << 17  # rows of the destination cache: the scatter lands anywhere in it


def bench_format(model: str, kind: str, fmt: RowFormat, rows: int, ceiling: float) -> dict:
    x = torch.randn(rows, fmt.dim, device=DEVICE).bfloat16()
    cache = torch.zeros(CACHE_ROWS, fmt.row_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.randperm(CACHE_ROWS, device=DEVICE)[:rows]
    reference = OPS["pack_rows"].reference
    nbytes = rows * (fmt.dim * 2 + fmt.row_bytes)
    row = {"model": model, "kind": kind, "rows": rows, "row_bytes": fmt.row_bytes}
    impls = {
        "pack": (lambda: cache_rows.pack_rows(x, fmt), nbytes, 100),
        "write": (lambda: cache_rows.write_rows(cache, dst, x, fmt), nbytes + 8 * rows, 100),
        "torch_pack": (lambda: reference(x, fmt), nbytes, 20),
        "torch_write": (lambda: cache.index_copy_(0, dst, reference(x, fmt)), nbytes, 20),
    }
    for name, (fn, moved, iters) in impls.items():
        ms = time_cuda(fn, iters=iters)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_TB/s"] = moved / (ms * 1e-3) / 1e12
    if rows <= 64:  # decode: device time without the host's launch overhead
        row["write_graph_us"] = time_graph(lambda: cache_rows.write_rows(cache, dst, x, fmt)) * 1e3
        row["torch_write_graph_us"] = (
            time_graph(lambda: cache.index_copy_(0, dst, reference(x, fmt))) * 1e3
        )
    row["write_%ceiling"] = 100 * row["write_TB/s"] / ceiling
    row["speedup_vs_torch_write"] = row["torch_write_us"] / row["write_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--rows", default="64,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cache_rows.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    results = []
    for model, kind, fmt in FORMATS:
        for rows in map(int, args.rows.split(",")):
            results.append(bench_format(model, kind, fmt, rows, ceiling))
            write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": results})
    cols = ["model", "kind", "rows", "row_bytes", "pack_us", "pack_TB/s", "write_us",
            "write_graph_us", "write_TB/s", "write_%ceiling", "torch_write_us",
            "torch_write_graph_us", "speedup_vs_torch_write"]  # fmt: skip
    print_table(results, cols)


if __name__ == "__main__":
    main()
