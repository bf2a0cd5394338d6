"""Routed experts (FP4 weights) on the GPU at V4-Flash (256 experts, top-6, hidden 4096, inter
2048, act group 128) and V4.1-Flash (384 experts, hidden 5120, inter 2304, group 32) shapes, for
a decode batch (64 tokens) and a prefill batch (8,192 tokens): the Triton path (default tiles,
batch-invariant tiles, a small tile sweep) vs the best torch built-in composition (dequantise the
used experts to bf16, ``torch._grouped_mm``, index_add combine) vs the same with weights
dequantised ahead of time (not possible for the whole model: 277 B parameters) vs the reference.
The sweep includes the opt-in ``pairs`` activation layout of ``moe_gemm``.
Also times routing (``route_topk``) against its torch reference.

Effective TFLOP/s counts ``6 * T * k * D * I``; TB/s counts the FP4 expert bytes touched (packed
weights + scales of every expert used at least once).

    python benchmarks/kernels/bench_moe.py --out bench-out/moe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_tbs, environment, print_table, time_cuda, time_graph, write_json  # noqa: E402

from deepinfer.kernels import OPS  # noqa: E402
from deepinfer.kernels.reference import moe as ref_moe  # noqa: E402
from deepinfer.kernels.reference import quant as ref_quant  # noqa: E402
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight  # noqa: E402
from deepinfer.kernels_nvidia import moe_experts, moe_route  # noqa: E402

DEVICE = "cuda"  # the benchmarks time CUDA kernels; a CPU smoke run may override it


MODELS = {"V4-Flash": (256, 4096, 2048, 128), "V4.1-Flash": (384, 5120, 2304, 32)}
SWEEP = {
    "decode": [moe_experts.MoeTiles(16, 64, 4, 4, pairs=True),
               moe_experts.MoeTiles(32, 128, 4, 4)],
    "prefill": [moe_experts.MoeTiles(128, 128, 8, 2, pairs=True),
                moe_experts.MoeTiles(64, 128, 4, 3, pairs=True),
                moe_experts.MoeTiles(64, 128, 8, 3)],
}  # fmt: skip


def _weights(experts, dim, inter):
    g = torch.Generator(device=DEVICE).manual_seed(experts)
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), DEVICE)
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), DEVICE)
    return w13, s13, w2, s2


def _dequant_bf16(packed, scale, chunk=32):
    parts = [ref_quant.fp4_dequant(packed[i : i + chunk], scale[i : i + chunk], 32)
             for i in range(0, packed.shape[0], chunk)]  # fmt: skip
    return torch.cat(parts)


def _grouped_matmul(rows, weight, offs):
    """``rows[offs[g-1]:offs[g]] @ weight[g]^T`` per group: ``torch._grouped_mm`` where this
    torch has it for these operands, else a loop of ``torch.mm``."""
    try:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)
    except (AttributeError, RuntimeError):
        ends = offs.tolist()
        out = rows.new_empty((rows.shape[0], weight.shape[1]))
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            if end > start:
                out[start:end] = rows[start:end] @ weight[g].t()
        return out


def torch_moe(x, weights, ids, w13_bf16, w2_bf16, limit):
    """bf16 grouped GEMMs over pre-dequantised experts (``[E', 2I, D]``, ``[E', D, I]``)."""
    top_k, inter = ids.shape[1], w13_bf16.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w13_bf16.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // top_k]
    gate_up = _grouped_matmul(rows, w13_bf16, offs)
    hidden = ref_moe.swiglu_clamped(gate_up[:, :inter], gate_up[:, inter:], limit)
    hidden = (hidden * weights.reshape(-1)[order, None]).bfloat16()
    down = _grouped_matmul(hidden, w2_bf16, offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // top_k, down.float())


def torch_moe_from_fp4(x, weights, ids, w13, s13, w2, s2, limit):
    used, local = torch.unique(ids, return_inverse=True)
    w13_bf16 = _dequant_bf16(w13[used], s13[used])
    w2_bf16 = _dequant_bf16(w2[used], s2[used])
    return torch_moe(x, weights, local, w13_bf16, w2_bf16, limit)


def _time(row, name, fn, flops, nbytes, iters=30, graph=False):
    try:
        ms = time_graph(fn, iters=iters) if graph else time_cuda(fn, warmup=2, iters=iters)
    except Exception as e:  # one failing variant must not hide the others
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        return
    row[f"{name}_us"] = ms * 1e3
    row[f"{name}_TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    row[f"{name}_TB/s"] = nbytes / (ms * 1e-3) / 1e12


def bench(model, tokens, weights_fp4, phase, with_reference):
    experts, dim, inter, group = MODELS[model]
    w13, s13, w2, s2 = weights_fp4
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=g, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    bias = torch.randn(experts, generator=g, device=DEVICE) * 0.1
    rkw = dict(scoring_func="sqrtsoftplus", route_scale=1.5, norm_eps=0.0, renormalize=True)
    weights, ids = moe_route.route_topk(logits, bias, 6, **rkw)
    used = torch.unique(ids).numel()
    per_expert = (w13.numel() + s13.numel() + w2.numel() + s2.numel()) // experts
    flops, nbytes = 6 * tokens * 6 * dim * inter, used * per_expert
    row = {"model": model, "tokens": tokens, "experts_used": used}
    kw = dict(swiglu_limit=10.0, act_quant_group=group)
    args = (x, weights, ids, w13, s13, w2, s2)
    _time(row, "triton", lambda: moe_experts.fp4_moe_experts_tiles(*args, **kw), flops, nbytes)
    if phase == "decode":  # the op never syncs with the host, so it replays in a CUDA graph
        _time(row, "triton_graph", lambda: moe_experts.fp4_moe_experts_tiles(*args, **kw),
              flops, nbytes, graph=True)  # fmt: skip
    bi = moe_experts.choose_tiles(tokens * 6, experts, batch_invariant=True, on_cpu=False)
    _time(row, "triton_bi", lambda: moe_experts.fp4_moe_experts_tiles(*args, **kw, tiles=bi),
          flops, nbytes)  # fmt: skip
    for i, tiles in enumerate(SWEEP[phase]):
        _time(row, f"sweep{i}", lambda t=tiles: moe_experts.fp4_moe_experts_tiles(*args, **kw, tiles=t),
              flops, nbytes)  # fmt: skip
    _time(row, "torch_fp4", lambda: torch_moe_from_fp4(*args, 10.0), flops, nbytes, iters=5)
    try:
        w13_bf16, w2_bf16 = _dequant_bf16(w13, s13), _dequant_bf16(w2, s2)
    except Exception as e:
        row["torch_bf16_error"] = f"{type(e).__name__}: {e}"[:300]
    else:
        pre = lambda: torch_moe(x, weights, ids, w13_bf16, w2_bf16, 10.0)  # noqa: E731
        _time(row, "torch_bf16", pre, flops, nbytes)
    if with_reference:
        ref = OPS["fp4_moe_experts"].reference
        _time(row, "reference", lambda: ref(*args, **kw), flops, nbytes, iters=2)
    route_ref = OPS["route_topk"].reference
    _time(row, "route_triton", lambda: moe_route.route_topk(logits, bias, 6, **rkw), 0, 0)
    _time(row, "route_torch", lambda: route_ref(logits, bias, 6, **rkw), 0, 0)
    if "triton_us" in row and "torch_fp4_us" in row:
        row["speedup_vs_torch_fp4"] = row["torch_fp4_us"] / row["triton_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", default="64,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs an NVIDIA GPU")
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = []
    for model, (experts, dim, inter, _) in MODELS.items():
        weights_fp4 = _weights(experts, dim, inter)
        for tokens in map(int, args.tokens.split(",")):
            phase = "decode" if tokens <= 256 else "prefill"
            rows.append(bench(model, tokens, weights_fp4, phase, with_reference=tokens <= 256))
            write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})
            print(
                {key: (round(v, 3) if isinstance(v, float) else v) for key, v in rows[-1].items()}
            )
        del weights_fp4
        torch.cuda.empty_cache()
    cols = ["model", "tokens", "triton_us", "triton_TFLOP/s", "triton_TB/s", "triton_graph_TB/s",
            "triton_bi_us",
            "torch_fp4_us", "torch_bf16_us", "speedup_vs_torch_fp4", "route_triton_us",
            "route_torch_us"]  # fmt: skip
    print_table(rows, cols)


if __name__ == "__main__":
    main()
