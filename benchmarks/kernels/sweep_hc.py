"""Throwaway exploration of the one-pass mHC pre (issue 8): why the first fused kernel was slow,
and which wait / tile shape / design is fastest. Every variant is compiled first in parallel
subprocesses, then timed (T 16,384 x 4 x D, bf16), checked against the two ops, and described
(registers, spills, shared memory, co-resident programs). --trace records per-program
timestamps of a few variants.

    python benchmarks/kernels/sweep_hc.py --out DIR
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_tbs, environment, time_cuda  # noqa: E402

from deepinfer import kernels  # noqa: E402
from deepinfer.kernels_nvidia import hc  # noqa: E402
from deepinfer.kernels_nvidia.hc_pre import HcPreSync, HcPreTiles, launch_hc_pre  # noqa: E402
from deepinfer.kernels_nvidia.hc_pre_pipelined import launch_pipelined  # noqa: E402

KW = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
# hc_pre.py as of 2eb72d3 (the 76 ms kernel), zlib + base64
ORIG = "eNqtWnlz28YV/x+fYstMa8CGKfGIrNDmTG3JGXfGVdxYTjuj0YAgsCAhEodxSGRcf/f+3tvFRVKynNSTiOTuvmPf/R7Q6/Wid2cizaTIC3chRRiLXy7eitTNc5HcykwUS9rKpBvlE+ElMghCL5RxkQvz139+tAGa3EivCJPYFnm4iJLQF0vp+rltfAzj1TLJYksEZS59cRcWS8bnJeu1m+ZSzGZbMRV5GTk3xMPVzbVY4s9sZosgycS4otw3jH8vt8IVczfLQplNAInzs5mIpfRzRtowIpIAR4tkJeMnubhbJmuiNBYbcQ6ILLmzhRv7HU4MhUdjfQnwdO1CFsVd8nwls1iuRZ6uw0JkdLW2UHAk9KQwfxJlHEIqoD2bXWpaReaSvIwwzgsA0uaPVl+8k5C3SxwvMjcSyV1MpN9cEgRxnQN8Njs/w28wWEYxo5Wut9RUbbGSMmU+IqjMyOQiBIUst8VdFhYyF8RK6mZF6K7bkjGDdDS0xeg5DkdiHgxO9L2wR5cqQByC95IMONyccE+ixJ/M+ktvZtViqzBDc8RZ/rl0AWDTXizuXJZDTDeU2fMihPhJbbcA8JIyBmnICsuGhIFthbcs4xWhITA+vQRlhpB+X7xerytJ5VqzdIZJZdIvPanU4UY1X8x3vZhkPiiaeULnYESLTEoxx53JxObq7lrx6oa1eWoLYQUwLEwJHF0upbF286JWYJFodgVoJyII4zBfSjanJC+gRcI6m3lJNMcPIsuyxjVg2B8IiczhXY1FVCJcb+vTCf5kSlZ5JSwYDmOxychzWYOHPslPGq5/43rwVWEqGYfKcgPwLsH+IoOvhrEvN9ZLMV8n3orBhB/mqVt4S0m7QKYkCPdmCYp1cgdoo4z1PX2lEHd9525zpTuojA2wUhvuF/rESBJ75IsxPF5dheRBR0EoiSUufguZfIp9HXkuYc1QT0hGAw2R6ZhnHz5pO82tFolSYXADOuTGLC/mWRtMSAKVRq2zJTmhWbsZTJEUBq+1oJQzYi6MF8KXqYx9rQs2FPJrMybTVb/htRbTwSXLdaFEOCf5ge1bNwvduADGj4VblAia74bHx7YYHg9Png8Gz0fH5DRgTW5crwAbvrQm+oe7cCluKFu5S0QChzcjdwP9BAGYJ1EeC7cwLsXgxB6djm1xLsbHP51YYl4W4uP7X/49ES9ORJRXl21hmohB/xhbYJ3cPKgtMn/SkqkbG3syfancwkVIJ5liETZawsC3EoaWwndIbsp1lLNz3L9N1i7rYZ1QBNUR0SCHLpIo9HJcy2ds3tKNKRMV4P4Fce8W4vSn0xfjH18gdl7ghAtVp+xUdJ5zy3zLJGW8CGP5EuExLaATDgKRdPMykxHZnwfQuYSqUukWAIP+5xDkMnKzVX6kIn1+xEvO0uunWwrJYcQBlQTVo0zJ2awHM+n1eoYRZEkkHCcoCxBxHBFGaZIRj+DNpaCb6zO+W7ge4kZO2NSheskw9EqRZN6y/sHW3/3VX0M6JaVqsFOsK9xIB2EMq+jrOzjxbeiHLsJ2RcvhQO/4SWEYF2fOz58+vj1H8h0L8UOTy5b6dkInPajCh00I87exOBK/jfsDsfScCHZuGRcfXhOC0ZAwtLNvWaQlpx/fl/5EDMesIluHUvHxX87ZL++hCkrlOpd28oihT0wBahjG32spmbjr7zKeXmaltAxeEu+8D5m8JMOdGAL/oJNLlUNTiiEcHdX16lBOG9rGETndLM37rEkC5zDoqCw8obgDLgYnrS0gaTaGp7xD4YzxVBvE9vnbn19/en/pXP7j/duPWGsYNS26lVbnTVgYvgyEQ37hLLKkTE1KY05aUPhaJwVChIqV+IzcfIWIgcOeLRa2eHM5gRH0vYTcaZNmVi2EqzeXtji9VqKtCjkSB0qiJotUibwSzWx2uhD9vjhdPHtBcY68v6B8CTQ2o67TKiK2yt9alBYLkY6scFsw5WbkxybYP7V4PQmCHFumybcSzzQf1tXEhlvHUv29Fk9xLezyLa/Uhj5xbWETBvdMLPBFCf+W8j0TJAmavEb/KiHiMBN+JlZXDRWgvLYFiXPKQt3hwVb5dnrcP7ZrjB4KMOmgHAoD1KDTXt9b9NSuRS4QRIhY+SpMeQnJqsxiYguiM4lJRNpNmE+PD2o/Db0VgnuBys4WN40az5TPzGY3UAfXljiEr5V6EQTw9bqWfZcsPu4o9JvV1SfXYjoVN3RzkMLtLM3V4DBXKF8cKluUWKNwo8xS+Qc+lT3O3Vxqe/Xctf7KsPyNEKhviB0oW6lRUJ2BE3LRysgvzrqmbBvIhHtixT0Jsa7TojnVdUFBWfGZaPUbFBPJUrMof848+cQ8l2T4vILsRkO0GbXYbnZN9uJM2Ww0pJ22hVzzOjPRWJ2WDFkti6Y+XNnrxRn+3FztmF40bBma1UY8RHZ+ympUPZXJ609rgrWggXZgEV29UemipmnVRBUBwoksI81KQQeZ3uOXTtdcK0w35Og3D0ApCY52JdiW4zpZUPn3bUnuyHNYU1s1IaKR66jx2s6/Rtj7plWzor8cFvbwHmG3GLLaHCmlSlcHRViqqfBrx9OyZFvmE7B9fUI8Z0CSQB3/2of546jydfpV42zDgCfldwdgzX3gQSseTxpgRZm6EYdCv3KUrh+D34GOXI+idA+b1uMxPMhrbehV/HnApkyojvRnHbAoRU/b1eEwqbKo0xRB5gYxZDPA//DwzcgWQVzFwnWTx/2QCpDQL5a2+I/z5ufByYPZHCGrTtgqmiWqbh/XFQ4n1JfdSmtyT7teB7+krDywiX8jbZcJcYpNPvOKCjJadT1PAfwusyQ3rzbH/XzppvLq+JrZtGkvgIsUFZ47jaeTbK/F3xSBbsS4c3SlQMK6atkHMdEksqdKdC2GmhKX5V95qZI94BVircs7pYMmItiEpVKEdQ/awb1o8YX1+SeQDx9CTgHmzxIYPURg9N0EAgg5gEQCMB5QmIcdFInZ0j05wf7ScH9ptLPE+PPPysrI6wPKhwFVjcGAvg3oG8kkoHQQEPPBqClmurWQKoK65jOl9gKlyOfawviGBx2c5jEOYp9DBbTJfa0uhLi/aMYZjce+1gOholN4q44YVNGtqSGYaA/Bli6cV7GdC+py6vEPzZtqh8WNfDkvF44eh5qczRSiYkkjyifN9I9jIM1ipCd9NdPK5Bo9sVQOvva173Mb7qBpay5IEZNvCCXnMpr2XO+zA+ie1o+UMcUGoEAVonx3ST0+b7xqyYUrOZoNqGGAGq52RwKTehCQ6EmO79NcDMgy3CPU/LboVqa8z26FWXeKWmYP3vC4uWEZZrLHIuUho17Zm8I9qceN9yilbYQs5mlLIpQsD5kaMhhU5aj+W5XduuiuUsjBanuri+7s/urbaHdFdlPMN+ZcN7NVfc/hoOGZO+nQl84GpWCcZJGq5h+q6ncbVFuc79b54uzD7sqhZHi4H0hDbb66C3VQKutKmk1ryieOjlq3UGUQ+5va/evuJneeuxnxzaVGq6YLU4W/3auqbZ3o9LFXLXnq+ovbVUX/KaShysmGzrnuPLwqYxLAK1LFfQ0Jsqi3n0U3KQXkTt2jY2wYFydjq12312qlppySbhfTccvZNun9vctm0DnYyYiHjg93j3dz3CGQ0S7I6FsgZPGUBv9UkTauqLTTnxpj1IawY0QPVVVND9YMKXbGIlbHtKy9hrKTzGy+pcId5g4/nJh+T9oyGqfYY/rsgzbI2iLVsVe7N75v7rMgIT1uvtUdcLW8bjH6gzhGDY4s0nfL8s9ZYaqZy2LEIxc0hOgwtJqpC6jCmzaijELJgmoQYGkrY69HvKc/XGkLXUFu430jZfztdj+TVt3PUNirJnTH/f6I56kMt2XLpnsAQF+kzd1eQaahnu2CDbpgg0eCDbtgw0eCjbpgB4u/2ke2j4th0Ntu9NoZAmwJlrH1/WKbyj7KIHoq4BRbqxlt7OeYMKjSxVQcN/1t48SZvHeOMm7NHdlPSQJMai+Gm2wallXR1I7cEIwoon9z0rSTBjqcRgjee0Z8kJ+mCV8M/qDnDRrP22ECXJ7ahPj7GBn+QUaGDzEyOLEJ83dxck+pR/9aI9P/17T00CRrp9QSF2fT8Y7lGqqe9JYSjreh5KZIa7K6U4GdbfpwHbQQf5kimaLd2OhefnBNS9WjosYMMxe1uPjNXZfybZYlmRn0NvTMMkVWlb6g4eqXCuor6hlIc5EUgpGKL0WZIhdpGtZX3UlQPQlNUS2nt+paFImOHhqQacceZcXYqzgPYnWW+DT1WUJE0cB6kOEgbnGscJhfNAbw/EXh+Gop1jXTFbmaa7BAEj3AhEWCZDm3Nkf2w0wRriMGajHXYss6IhSKpd7h+SZ35T3Nb8Ob9fVIr7V4omscDHYbFR754SraNJOfSfbnHJ3JXdTvQz8Rux9tJ/TyyVGQ8h96J4UFrUmTgJX9qnZI90F7RmyLp49oRNRz7UnrCZz4L7s07Io+jKZrn83o8SYct/2mEz0DpkaQN6uXQ7Co31lYu2XsLffeluqrmore5CGXoKfz1/RIjV+6ORJ0c/7g+UdA2K9oHjHmY+qWao1/8nXp94iQEFSf0f+qhwWzmbll1zu/rvTHyYbXxnp+X//giarmanxtEVuEUtzJcLEsckvFHPm5dNf0ckvrvYEn9WsOJj8FZLDILZYvdY7My4jf5nBFEG6kfnfE6lcC5s/7g5IWGaKAMkTVmJjIysi9A37qUy8OeLGKVsNrIdcQ2YY6xiJclEmZmw8GF1/e8go+Q0/W5ZQyZxmlxdYEpI//SJrTWqrq/BQfndqtC8YEGa7jHgeg9YOkBtxZhysuKrpPBvbxP5oGvd6xU7zoscRWVyTq6Q6RqlvnqsXNKZR1Hmarp+FFtd9vPzPnvR/oFanOSztZGbdeB6IX60B9wu5TvZBTPa6vXlaJE34NKowX2np8bsnVuCSWG6TL5E5mThI4Q9O36JK4cJ8jF+7a89Kyp0yizSXVh3VqafodhdXzw1uTFO5ZzSikEkXrCEQ1LzrdZVs7DVS7J8SPOeDopYlHag1h6AHM34mMm78anRrb1+i6OKC3Qxi6k6mre65pW9fNI3h2cMWTaXX8Unn9PVsqRx3cq1HvG67qgXmupWdazWnlx+1BVh1FaLD9uFGWGmdNSfDnZ1Pfo854Ss/zaGx/2CxbHXaLdzVDqAIKGetuhq1fKJkq261/f+t1gwP+/D+Nq7+X"

T_, S_ = HcPreTiles, HcPreSync
ORIG_SYNC = S_(wait=1, sleep_ns=0, counter_stride=1, all_reduce=True)
VARIANTS = [  # (name, tiles, sync, given pre, dim)
    ("orig-as-is", T_(16, 128, 4), None, False, 4096),
    ("allred-16x128x4", T_(16, 128, 4), ORIG_SYNC, False, 4096),
    ("allred-16x128x4-stride32", T_(16, 128, 4), S_(1, 0, 32, True), False, 4096),
    ("allred-16x128x4-sleep64", T_(16, 128, 4), S_(1, 64, 32, True), False, 4096),
    ("allred-16x128x4-nowait", T_(16, 128, 4), S_(0, 0, 32, True), False, 4096),
    ("last-16x128x4-atomic", T_(16, 128, 4), S_(2, 64, 32), False, 4096),
    ("last-16x128x4-spin", T_(16, 128, 4), S_(1, 0, 32), False, 4096),
    ("last-16x128x4-sleep256", T_(16, 128, 4), S_(1, 256, 32), False, 4096),
]
for bt, dc, w in [(16, 128, 4), (16, 64, 4), (32, 64, 4), (32, 32, 4), (64, 32, 4),
                  (32, 128, 4), (32, 64, 8), (64, 64, 8)]:  # fmt: skip
    VARIANTS.append((f"last-{bt}x{dc}x{w}", T_(bt, dc, w), S_(), False, 4096))
for bt, dc, w in [(16, 128, 4), (32, 64, 4), (32, 32, 4), (64, 32, 4)]:
    VARIANTS.append((f"last-{bt}x{dc}x{w}-nowait", T_(bt, dc, w), S_(wait=0), False, 4096))
for bt, dc, w in [(16, 64, 4), (32, 64, 4), (32, 32, 4)]:
    VARIANTS.append((f"reread-{bt}x{dc}x{w}", T_(bt, dc, w), S_(reread=True), False, 4096))
for bt, dc, w in [(16, 64, 4), (32, 64, 4), (32, 32, 4), (64, 32, 4)]:
    VARIANTS.append((f"given-{bt}x{dc}x{w}", T_(bt, dc, w), S_(), True, 4096))
for bt, dc, w in [(64, 32, 4), (32, 32, 4), (16, 64, 4), (32, 64, 4), (16, 32, 4)]:
    VARIANTS.append((f"pipe-{bt}x{dc}x{w}", T_(bt, dc, w), "pipe", False, 4096))
VARIANTS.append(("pipe-64x32x4-sleep0", T_(64, 32, 4), "pipe0", False, 4096))
for bt, dc, w in [(32, 64, 4), (32, 32, 4)]:
    VARIANTS.append((f"given-{bt}x{dc}x{w}-D5120", T_(bt, dc, w), S_(), True, 5120))
    VARIANTS.append((f"last-{bt}x{dc}x{w}-D5120", T_(bt, dc, w), S_(), False, 5120))
    VARIANTS.append((f"pipe-{bt}x{dc}x{w}-D5120", T_(bt, dc, w), "pipe", False, 5120))


LOG: list[Path] = []


def emit(rows, row):
    """Keep, print and append the row to the log at once (a later hang loses nothing)."""
    rows.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    for path in LOG:
        with path.open("a") as f:
            f.write(line + "\n")


def orig_module():
    path = Path(tempfile.gettempdir()) / "hc_pre_orig.py"
    path.write_text(zlib.decompress(base64.b64decode(ORIG)).decode())
    spec = importlib.util.spec_from_file_location("hc_pre_orig", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hc_pre_orig"] = mod
    spec.loader.exec_module(mod)
    return mod


def inputs(tokens, dim, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, 4, dim, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * dim, device="cuda", generator=g) * (4 * dim) ** -0.5
    base = torch.randn(24, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    given = torch.rand(tokens, 4, device="cuda", generator=g) + 0.1
    return x, fn, base, scale, given


def runner(variant, args, trace=None):
    name, tiles, sync, given, _ = variant
    x, fn, base, scale, gpre = args
    if isinstance(sync, str):  # the pipelined persistent grid
        ns = 0 if sync == "pipe0" else 64
        return lambda: launch_pipelined(x, fn, base, scale, KW, tiles, sleep_ns=ns)
    if sync is None:
        mod = orig_module()
        return lambda: (
            *mod.hc_pre(x, fn, base, scale, tiles=mod.HcPreTiles(*vars(tiles).values()), **KW),
            None,
        )  # noqa: E501
    return lambda: launch_hc_pre(x, fn, base, scale, gpre if given else None, KW, tiles, sync,
                                 trace=trace)  # fmt: skip


def occupancy(kernel, warps):
    if kernel is None or not hasattr(kernel, "n_regs"):
        return {}
    regs, smem = kernel.n_regs, kernel.metadata.shared
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (65536 // per_warp) // warps
    by_smem = (233472 // (smem + 1024)) if smem else 32
    return {"regs": regs, "spills": kernel.n_spills, "smem": smem,
            "ctas_per_sm": min(by_regs, by_smem, 64 // warps, 32)}  # fmt: skip


def errors(out, want):
    return [float((a.float() - b.float()).abs().max()) for a, b in zip(out[:4], want)]


def summarize_trace(trace, num_chunks):
    t = trace.cpu().double()
    t0, t1, t2, t3 = (t[:, i] - t[:, 0].min() for i in range(4))
    waiters = t[:, 2] > 0
    ev = torch.cat(
        [torch.stack([t0, torch.ones_like(t0)], 1), torch.stack([t3, -torch.ones_like(t3)], 1)]
    )
    ev = ev[ev[:, 0].argsort()]
    conc = ev[:, 1].cumsum(0).max()
    tiles = t0.shape[0] // num_chunks
    t0t, t1t = t0[: tiles * num_chunks].view(tiles, -1), t1[: tiles * num_chunks].view(tiles, -1)
    med = lambda v: float(v.median()) if v.numel() else -1.0  # noqa: E731
    return {
        "span_us": float(t3.max()) / 1e3, "max_concurrent": int(conc),
        "load_proj_us": med(t1 - t0) / 1e3, "wait_us": med((t2 - t1)[waiters]) / 1e3,
        "after_wait_us": med((t3 - t2)[waiters]) / 1e3, "program_us": med(t3 - t0) / 1e3,
        "tile_arrival_spread_us": med(t1t.max(1).values - t0t.min(1).values) / 1e3,
        "tile_start_spread_us": med(t0t.max(1).values - t0t.min(1).values) / 1e3,
        "sms_used": int(t[:, 4].unique().numel()),
    }  # fmt: skip


def warm_all(parallel):
    jobs = [[sys.executable, __file__, "--warm", str(i)] for i in range(len(VARIANTS))]
    for start in range(0, len(jobs), parallel):
        procs = [subprocess.Popen(j) for j in jobs[start : start + parallel]]
        for p in procs:
            p.wait()


def time_variant(variant, ceiling, rows):
    name, tiles, sync, given, dim = variant
    tokens = 16384
    args = inputs(tokens, dim)
    x, fn, base, scale, gpre = args
    row = {"variant": name, "dim": dim, "tokens": tokens}
    try:
        fn_ = runner(variant, args)
        out = fn_()
        torch.cuda.synchronize()
        want = kernels.OPS["hc_pre"].reference(
            x, fn, base, scale, collapse_pre=gpre if given else None, **KW
        )
        row["err_y_pre_post_comb"] = errors(out, want)
        row.update(occupancy(out[4], tiles.num_warps))
        slow = time_cuda(fn_, warmup=1, iters=1) > 5
        ms = time_cuda(fn_, warmup=1, iters=3 if slow else 30)
        row["us"] = ms * 1e3
        row["TB/s"] = tokens * 5 * dim * 2 / ms / 1e9
        row["%copy"] = 100 * row["TB/s"] / ceiling
    except Exception as e:  # a variant that does not compile or run is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    emit(rows, row)


def trace_variant(variant, rows, tokens=4096):
    name, tiles, sync, given, dim = variant
    if sync is None or isinstance(sync, str):
        return
    args = inputs(tokens, dim)
    num_chunks = -(-dim // tiles.block_cols)
    num_programs = -(-tokens // tiles.block_tokens) * num_chunks
    trace = torch.zeros(num_programs, 8, dtype=torch.int64, device="cuda")
    try:
        runner(variant, args, trace)()
        trace.zero_()
        runner(variant, args, trace)()
        torch.cuda.synchronize()
        row = {"trace": name, "tokens": tokens, **summarize_trace(trace, num_chunks)}
    except Exception as e:
        row = {"trace": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    emit(rows, row)


def two_op_rows(ceiling, rows):
    for dim in (4096, 5120):
        x, fn, base, scale, gpre = inputs(16384, dim)

        def two(x=x, fn=fn, base=base, scale=scale):
            p, post, comb = hc.hc_mix_coefficients(x, fn, base, scale, **KW)
            return hc.hc_collapse(x, p), post, comb

        ms = time_cuda(two, iters=30)
        row = {"variant": "two-op", "dim": dim, "us": ms * 1e3,
               "TB/s": 16384 * 5 * dim * 2 / ms / 1e9}  # fmt: skip
        row["%copy"] = 100 * row["TB/s"] / ceiling
        emit(rows, row)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--parallel", type=int, default=16)
    args = parser.parse_args()
    if args.warm is not None:
        variant = VARIANTS[args.warm]
        try:
            runner(variant, inputs(256, variant[4]))()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"warm {variant[0]} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        LOG.append(Path(args.out) / "sweep_hc.jsonl")
    warm_all(args.parallel)
    ceiling = copy_bandwidth_tbs()
    print(f"copy {ceiling:.2f} TB/s", flush=True)
    rows = [{"copy_TB/s": ceiling}]
    two_op_rows(ceiling, rows)
    for variant in VARIANTS:
        time_variant(variant, ceiling, rows)
    for name in ("allred-16x128x4", "allred-16x128x4-sleep64", "last-16x128x4", "last-32x64x4",
                 "reread-32x64x4", "given-32x64x4"):  # fmt: skip
        trace_variant(next(v for v in VARIANTS if v[0] == name), rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        payload = {"env": environment(), "rows": rows}
        (Path(args.out) / "sweep_hc.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
