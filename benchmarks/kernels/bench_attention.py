"""Sparse MQA with sink over index lists on the GPU, at V4-Flash / V4.1-Flash attention shapes
(64 query heads, one K=V head of 512, 640 entries per row = 128 window + 512 compressed, a
128k-position arena), plus partial RoPE: Triton kernels vs the reference vs the best torch
built-in (gather the rows, then SDPA with a mask; no sink, so a lower bound on its cost).

Counted: decode = KV bytes gathered (rows x 640 x 512 x bytes per element, each row's own
list); prefill = FLOPs, 4 x T x H x K x D (QK^T and PV), "bf16-equivalent". Ceilings: the copy
rate measured in the same run; 790 TFLOP/s bf16 dense (KINDS.md measured rate).
A small sweep of launch tiles and both launch paths (split, whole list) runs first; the best is
reported with its parameters, beside the default policy's time.

    python -m benchmarks.kernels.bench_attention --out bench-out/attention.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer import kernels
from deepinfer.kernels_nvidia import backend
from deepinfer.kernels_nvidia.attention import AttentionTiles

HEADS, DIM, WINDOW, ENTRIES, ARENA = 64, 512, 128, 512, 131072
BF16_TFLOPS = 790.0
SPLIT, WHOLE = 10**9, 0  # split_rows_max forcing each launch path
DECODE_SWEEP = [
    AttentionTiles(split_rows_max=SPLIT),
    AttentionTiles(block_n=64, num_stages=3, split_rows_max=SPLIT),
    AttentionTiles(split_size=256, split_rows_max=SPLIT),
    AttentionTiles(block_n=64, num_stages=3, split_rows_max=WHOLE),
    AttentionTiles(head_block=32, block_n=64, num_stages=3, split_rows_max=WHOLE),
    AttentionTiles(split_rows_max=WHOLE),
    AttentionTiles(block_n=16, split_rows_max=WHOLE),  # no register spills (sm_90 AOT, bf16)
]
PREFILL_SWEEP = [
    AttentionTiles(block_n=64, num_stages=2, split_rows_max=WHOLE, halves=True),
    AttentionTiles(head_block=32, block_n=64, num_stages=2, split_rows_max=WHOLE, halves=True),
    AttentionTiles(block_n=64, num_stages=3, split_rows_max=WHOLE),
]


def make_inputs(rows: int, kv_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, HEADS, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(ARENA + WINDOW * 4, DIM, device="cuda", generator=g).to(kv_dtype)
    win = torch.randint(ARENA, ARENA + WINDOW * 4, (rows, WINDOW), device="cuda", generator=g)
    comp = torch.randint(0, ARENA, (rows, ENTRIES), device="cuda", generator=g)
    idx = torch.cat([win, comp], 1).int()
    sink = torch.randn(HEADS, device="cuda", generator=g)
    return q, kv, idx, sink, DIM**-0.5


def sdpa_baseline(q, kv, idx, sink, scale):
    """Gather each row's entries, then SDPA with the 64 heads as 64 queries of one head."""
    gathered = kv[idx.clamp(min=0).long()].to(q.dtype)[:, None]  # [T, 1, K, D]
    mask = (idx >= 0)[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(
        q[:, None], gathered, gathered, attn_mask=mask, scale=scale
    )


def try_time(fn, **kw) -> float:
    """Median ms, or NaN (with the reason printed) when a baseline cannot run at this shape."""
    try:
        return time_cuda(fn, **kw)
    except Exception as e:
        print(f"baseline failed: {type(e).__name__}: {str(e)[:160]}")
        return float("nan")


def best_tiles(args, sweep, iters):
    fn = backend.ops["sparse_mqa_sink"]
    timed = []
    for tiles in sweep:
        try:
            timed.append((time_cuda(lambda t=tiles: fn(*args, tiles=t), iters=iters), tiles))
            print(f"  T={args[0].shape[0]} {_tiles_str(tiles)}: {timed[-1][0] * 1e3:.1f} us")
        except Exception as e:  # a tile shape that does not compile (shared memory) is skipped
            print(f"tiles {tiles} failed: {type(e).__name__}: {str(e)[:120]}")
    return min(timed, key=lambda x: x[0])


def bench_decode(rows: int, kv_dtype: torch.dtype, ceiling: float, sweep=DECODE_SWEEP) -> dict:
    """Best of ``sweep`` for ``rows`` decode rows; also the default policy's time."""
    args = make_inputs(rows, kv_dtype)
    ms, tiles = best_tiles(args, sweep, iters=50)
    gathered = rows * (WINDOW + ENTRIES) * DIM * args[1].element_size()
    row = {"case": f"decode T={rows} kv={str(kv_dtype).removeprefix('torch.')}",
           "triton_us": ms * 1e3, "triton_TB/s": gathered / ms / 1e9,
           "%ceiling": 100 * gathered / ms / 1e9 / ceiling, "tiles": _tiles_str(tiles)}  # fmt: skip
    default_ms = time_cuda(lambda: backend.ops["sparse_mqa_sink"](*args), iters=50)
    row["default_us"] = default_ms * 1e3
    ref_ms = try_time(lambda: kernels.OPS["sparse_mqa_sink"].reference(*args), iters=10)
    sdpa_ms = try_time(lambda: sdpa_baseline(*args), iters=10)
    row.update(reference_us=ref_ms * 1e3, torch_sdpa_us=sdpa_ms * 1e3)
    return row


def bench_prefill(rows: int) -> dict:
    args = make_inputs(rows, torch.bfloat16)
    ms, tiles = best_tiles(args, PREFILL_SWEEP, iters=10)
    flops = 4 * rows * HEADS * (WINDOW + ENTRIES) * DIM
    row = {"case": f"prefill T={rows} kv=bfloat16", "triton_us": ms * 1e3,
           "triton_TFLOP/s": flops / ms / 1e9, "%ceiling": 100 * flops / ms / 1e9 / BF16_TFLOPS,
           "tiles": _tiles_str(tiles)}  # fmt: skip
    sdpa_ms = try_time(lambda: sdpa_baseline(*args), warmup=1, iters=3)
    row.update(torch_sdpa_us=sdpa_ms * 1e3, torch_sdpa_TFLOP_s=flops / sdpa_ms / 1e9)
    return row


def bench_rope(rows: int, ceiling: float, heads: int = HEADS, dim: int = DIM,
               in_place: bool = False) -> dict:  # fmt: skip
    """The inverse RoPE of a ``[rows, heads, dim]`` bf16 tensor's last 64 channels: out of
    place (every channel read and written), or in place (``out=x``: the rotary channels
    only, as the model calls it: q and o at 64 x 512, the KV row at 1 x 512, the indexer's
    queries at 64 x 128)."""
    x = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(rows, 32, device="cuda") * 100
    cos, sin = ang.cos(), ang.sin()
    op = backend.ops["apply_rope"]
    if in_place:
        nbytes = 2 * rows * heads * 64 * 2
        ms = time_cuda(lambda: op(x, cos, sin, inverse=True, out=x))
    else:
        nbytes = 2 * x.numel() * 2
        ms = time_cuda(lambda: op(x, cos, sin, inverse=True))
    ref_ms = time_cuda(lambda: kernels.OPS["apply_rope"].reference(x, cos, sin, inverse=True))
    form = "in place" if in_place else "inverse"
    return {"case": f"apply_rope {form} [{rows},{heads},{dim}]", "triton_us": ms * 1e3,
            "triton_TB/s": nbytes / ms / 1e9, "%ceiling": 100 * nbytes / ms / 1e9 / ceiling,
            "reference_us": ref_ms * 1e3}  # fmt: skip


def _tiles_str(t: AttentionTiles) -> str:
    path = f"split{t.split_size}" if t.split_rows_max == SPLIT else "whole"
    path += "-halves" if t.halves and path == "whole" else ""
    return f"hb{t.head_block}/bn{t.block_n}/{path}/w{t.num_warps}/s{t.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--prefill-rows", type=int, default=8192)
    parser.add_argument("--sections", default="decode,prefill,rope")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows, sections = [], args.sections.split(",")
    if "decode" in sections:
        for t in (64, 256):
            rows.append(bench_decode(t, torch.float8_e4m3fn, ceiling))
            print(rows[-1])
        rows.append(bench_decode(64, torch.bfloat16, ceiling, DECODE_SWEEP[::3]))
        rows.append(bench_decode(4, torch.float8_e4m3fn, ceiling, DECODE_SWEEP[::3]))
    if "prefill" in sections:
        rows.append(bench_prefill(args.prefill_rows))
        print(rows[-1])
    if "rope" in sections:
        for t in (64, 8192):
            rows.append(bench_rope(t, ceiling))
        for heads, dim in ((HEADS, DIM), (1, DIM), (HEADS, 128)):
            rows.append(bench_rope(8192, ceiling, heads, dim, in_place=True))
    cols = ["case", "triton_us", "triton_TB/s", "triton_TFLOP/s", "%ceiling", "default_us",
            "reference_us", "torch_sdpa_us", "tiles"]  # fmt: skip
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
