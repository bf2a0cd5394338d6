"""mHC on the GPU at V4-Flash (D 4096) and V4.1-Flash (D 5120) widths, 4 streams, bf16:
Triton kernels vs the reference (plain torch, cuBLAS for the projection), in one run.

pre, the ``hc_pre`` op (coefficients with Sinkhorn + the collapse):
  "pre fused deferred"  V4.1: ``collapse_pre`` given, ONE launch reading the streams once;
  "pre fused v4"        V4: the same streaming coefficient launch, then the collapse
                        (``hc_collapse``) reading the streams again;
  "pre two-op"          ``hc_mix_coefficients`` (two launches) + ``hc_collapse``;
  reference             the op's plain-torch twin.
post = hc_expand (``post f + C^T h``), Triton vs reference.
Bytes counted are the fewest the step must move: pre reads the streams once and writes the
collapsed row (T x 5 x D x 2 B); post reads f and the streams and writes the new streams
(T x 9 x D x 2 B). Ceiling: the copy rate measured in the same run. ``--sweep`` also times the
fused pre's launch shapes (each compiled first, in parallel subprocesses).

    python -m benchmarks.kernels.bench_hc --tokens 16384 --sweep --out bench-out/hc.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer import kernels
from deepinfer.kernels_nvidia import hc
from deepinfer.kernels_nvidia.hc_pre import DEFAULT_TILES, HcPreTiles, hc_pre

NC = 4
KW = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
# The first shape is the measured fastest (the default; RESULTS.md, mHC pre); 8-warp and
# 16-column-step shapes were much slower. The neighbours below are unmeasured.
SWEEP = [  # (tokens per program, chunk columns, warps, columns per step, stages[, chunk-major])
    HcPreTiles(64, 512, 4, 32, 3), HcPreTiles(64, 512, 4, 32, 3, True),
    HcPreTiles(64, 1024, 4, 32, 3), HcPreTiles(64, 256, 4, 32, 3), HcPreTiles(128, 512, 4, 32, 3),
    HcPreTiles(64, 512, 4, 32, 2), HcPreTiles(64, 512, 4, 64, 2),
]  # fmt: skip


def _inputs(tokens: int, dim: int):
    g = torch.Generator(device="cuda").manual_seed(tokens + dim)
    h = torch.randn(tokens, NC, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    f = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    fn = torch.randn((2 + NC) * NC, NC * dim, device="cuda", generator=g) * (NC * dim) ** -0.5
    base = torch.randn((2 + NC) * NC, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    given = torch.rand(tokens, NC, device="cuda", generator=g) + 0.1
    return h, f, fn, base, scale, given


def _pre_variants(h, fn, base, scale, given, tiles=None):
    ref = kernels.OPS["hc_pre"].reference

    def two_op():
        p, post, comb = hc.hc_mix_coefficients(h, fn, base, scale, **KW)
        return hc.hc_collapse(h, p), post, comb

    return {
        "pre fused deferred": lambda: hc_pre(
            h, fn, base, scale, collapse_pre=given, tiles=tiles, **KW
        ),  # fmt: skip
        "pre fused v4": lambda: hc_pre(h, fn, base, scale, tiles=tiles, **KW),
        "pre two-op": two_op,
        "pre reference": lambda: ref(h, fn, base, scale, **KW),
    }


def _row(stage, dim, tokens, ms, nbytes, ceiling, **extra):
    tbs = nbytes / ms / 1e9
    return {"stage": stage, "dim": dim, "tokens": tokens, "us": ms * 1e3, "TB/s": tbs,
            "%copy": 100 * tbs / ceiling, **extra}  # fmt: skip


def _errors(got, want) -> dict:
    """Largest differences from the reference: y (bf16 steps) and the fp32 weights."""
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)]
    return {"y_err": diffs[0], "coeff_err": max(diffs[1:])}


def bench_shape(tokens: int, dim: int, ceiling: float) -> list[dict]:
    h, f, fn, base, scale, given = _inputs(tokens, dim)
    pre_bytes, post_bytes = tokens * 5 * dim * 2, tokens * 9 * dim * 2
    want = kernels.OPS["hc_pre"].reference(h, fn, base, scale, collapse_pre=given, **KW)
    rows = []
    for name, fn_ in _pre_variants(h, fn, base, scale, given).items():
        extra = _errors(fn_(), want) if name == "pre fused deferred" else {}
        rows.append(_row(name, dim, tokens, time_cuda(fn_, iters=50), pre_bytes, ceiling, **extra))
        print(rows[-1], flush=True)
    _, post, comb = want[1:]
    ref_expand = kernels.OPS["hc_expand"].reference
    for name, fn_ in (("post", lambda: hc.hc_expand(f, h, post, comb)),
                      ("post reference", lambda: ref_expand(f, h, post, comb))):  # fmt: skip
        rows.append(_row(name, dim, tokens, time_cuda(fn_, iters=50), post_bytes, ceiling))
        print(rows[-1], flush=True)
    pre = want[1]
    rows.append(_row("  collapse alone", dim, tokens, time_cuda(lambda: hc.hc_collapse(h, pre)),
                     pre_bytes, ceiling))  # fmt: skip
    return rows


def sweep_shape(tokens: int, dim: int, ceiling: float) -> list[dict]:
    h, _, fn, base, scale, given = _inputs(tokens, dim)
    rows = []
    for tiles in SWEEP:
        for name in ("pre fused deferred", "pre fused v4"):
            fn_ = _pre_variants(h, fn, base, scale, given, tiles)[name]
            try:
                ms = time_cuda(fn_, warmup=3, iters=30)
            except Exception as e:  # a shape that does not compile is reported, not fatal
                print(f"{name} {tiles}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tag = "x".join(map(str, vars(tiles).values()))
            rows.append(_row(f"sweep {name} {tag}", dim, tokens, ms, tokens * 5 * dim * 2,
                             ceiling))  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def _warm(index: int) -> None:
    """Compile SWEEP[index] in both modes (a subprocess: Triton's cache keeps the binaries)."""
    for dim in (4096, 5120):
        h, _, fn, base, scale, given = _inputs(128, dim)
        for name in ("pre fused deferred", "pre fused v4"):
            _pre_variants(h, fn, base, scale, given, SWEEP[index])[name]()
    torch.cuda.synchronize()


def _warm_all(parallel: int = 16) -> None:
    jobs = [
        [sys.executable, "-m", "benchmarks.kernels.bench_hc", "--warm", str(i)]
        for i in range(len(SWEEP))
    ]
    for start in range(0, len(jobs), parallel):
        for proc in [subprocess.Popen(j) for j in jobs[start : start + parallel]]:
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="16384")
    parser.add_argument("--sweep", action="store_true", help="also time the pre launch shapes")
    parser.add_argument("--warm", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_hc.py needs an NVIDIA GPU")
    if args.warm is not None:
        return _warm(args.warm)
    if args.sweep:
        _warm_all()
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s; default pre tiles {DEFAULT_TILES}")
    rows = []
    for dim in (4096, 5120):
        for tokens in map(int, args.tokens.split(",")):
            rows += bench_shape(tokens, dim, ceiling)
            if args.sweep and tokens >= 4096:
                rows += sweep_shape(tokens, dim, ceiling)
    cols = ["stage", "dim", "tokens", "us", "TB/s", "%copy", "y_err", "coeff_err"]
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling,
                          "default_tiles": vars(DEFAULT_TILES), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
