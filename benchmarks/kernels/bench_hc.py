"""mHC on the GPU at V4-Flash (D 4096) and V4.1-Flash (D 5120) widths, 4 streams, bf16:
Triton kernels vs the reference (plain torch, cuBLAS for the projection).

pre  = hc_mix_coefficients + hc_collapse (the coefficients, Sinkhorn, then the collapse: two ops,
       the streams read twice); "pre fused" = ``kernels_nvidia.hc_pre.hc_pre`` (one launch, the
       streams read once; not an op yet); the coefficients' projection M is swept (16 / 64);
post = hc_expand (``post f + C^T h``).
Bytes counted are the fewest the step must move: pre reads the streams once and writes the
collapsed row (T x 5 x D x 2 B); post reads f and the streams and writes the new streams
(T x 9 x D x 2 B). Ceiling: the copy rate measured in the same run.

    python benchmarks/kernels/bench_hc.py --out bench-out/hc.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json  # noqa: E402

from deepinfer import kernels  # noqa: E402
from deepinfer.kernels_nvidia import backend  # noqa: E402
from deepinfer.kernels_nvidia.hc_pre import hc_pre  # noqa: E402

NC = 4
KW = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}


def _ops(impl):
    def pre(h, fn, base, scale):
        p, post, comb = impl["hc_mix_coefficients"](h, fn, base, scale, **KW)
        return impl["hc_collapse"](h, p), post, comb

    def post(f, h, p, comb):
        return impl["hc_expand"](f, h, p, comb)

    return pre, post


def bench_shape(tokens: int, dim: int, ceiling: float) -> list[dict]:
    width = NC * dim
    h = torch.randn(tokens, NC, dim, device="cuda", dtype=torch.bfloat16)
    f = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    fn = torch.randn((2 + NC) * NC, width, device="cuda") * width**-0.5
    base = torch.randn((2 + NC) * NC, device="cuda")
    scale = torch.rand(3, device="cuda") + 0.5
    impls = {
        "triton": _ops(backend.ops),
        "reference": _ops({n: kernels.OPS[n].reference for n in backend.ops}),
    }
    _, post_c, comb_c = impls["reference"][0](h, fn, base, scale)
    rows = []
    for stage, nbytes in (("pre", tokens * 5 * dim * 2), ("post", tokens * 9 * dim * 2)):
        row = {"stage": stage, "dim": dim, "tokens": tokens}
        for name, (pre, post) in impls.items():
            fn_ = (lambda p=pre: p(h, fn, base, scale)) if stage == "pre" else (
                lambda q=post: q(f, h, post_c, comb_c))  # fmt: skip
            ms = time_cuda(fn_, iters=50)
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_TB/s"] = nbytes / ms / 1e9
        row["triton_%ceiling"] = 100 * row["triton_TB/s"] / ceiling
        rows.append(row)
    pre_c = kernels.OPS["hc_mix_coefficients"].reference(h, fn, base, scale, **KW)[0]
    ops = backend.ops
    rows[0]["coefficients_us"] = 1e3 * time_cuda(
        lambda: ops["hc_mix_coefficients"](h, fn, base, scale, **KW), iters=50
    )
    rows[0]["collapse_us"] = 1e3 * time_cuda(lambda: ops["hc_collapse"](h, pre_c), iters=50)
    for bt in (64, 32):
        us = 1e3 * time_cuda(lambda b=bt: ops["hc_mix_coefficients"](
            h, fn, base, scale, tokens_per_program=b, **KW), iters=50)  # fmt: skip
        rows[0][f"coefficients_m{bt}_us"] = us
    fused = {"stage": "pre fused", "dim": dim, "tokens": tokens}
    ms = time_cuda(lambda: hc_pre(h, fn, base, scale, **KW), iters=20)
    fused.update({"triton_us": ms * 1e3, "triton_TB/s": tokens * 5 * dim * 2 / ms / 1e9})
    fused["triton_%ceiling"] = 100 * fused["triton_TB/s"] / ceiling
    rows.append(fused)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="64,4096,16384")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_hc.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = []
    for dim in (4096, 5120):
        for tokens in map(int, args.tokens.split(",")):
            rows += bench_shape(tokens, dim, ceiling)
    cols = ["stage", "dim", "tokens", "triton_us", "triton_TB/s", "triton_%ceiling",
            "coefficients_us", "coefficients_m64_us", "coefficients_m32_us", "collapse_us",
            "reference_us", "reference_TB/s"]  # fmt: skip
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
