"""Context-parallel prefill of one long prompt: per-rank work counted at full size, time and
peak memory measured on CPU processes at a tiny width.

Counted (no weights, the model built on the meta device at the published V4-Flash shapes, or
V4.1-Flash with ``--model v41-flash``): for a prompt of each ``--lengths`` with CP = 1 and CP =
``--cp``, per rank the attention FLOPs of its balanced-split queries
(:func:`deepinfer.parallel.context.attention_flops`) and the linear FLOPs of its own rows; then,
for each exchange of ``context_parallel_prefill`` (``hidden``: every row's attention inputs;
``borders``: the rows before a rank's pieces and the step's tail, plus every rank's finished
entries and index keys), the rows a rank computes keys for, their linear FLOPs, the bytes it
receives and the counted peak of live activations.

Measured (``--measure-lengths``, a tiny random V4 checkpoint with the released window and
top-k): ``cp`` spawned gloo processes run the CP prefill; one process runs the plain forward
for CP = 1. Each reports its prefill time and its peak resident memory above the resident
memory just before the prefill (the peak is reset through ``/proc/self/clear_refs``; large
allocations are returned to the system at free, so the peak follows the live tensors).
``peak_fit`` fits ``a + b N + c N^2`` per CP to those peaks and projects them to the counted
lengths (the visible-entry lists and indexer scores grow with ``N^2``).

    python -m benchmarks.parallel.bench_context --cp 4 --out bench-out/context.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import tempfile
import time

import torch
from torch import nn

from benchmarks.common import environment, write_json
from benchmarks.model.dummy_forward import v4_flash_config
from benchmarks.parallel.ep_projection import V4_RATIOS, v41_flash_config
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.context_exchange import border_sends, needed_rows, reach
from deepinfer.engine.model.context_prefill import RowSplit, attention_shape
from deepinfer.engine.model.model import build_model
from deepinfer.parallel.context import attention_flops

KEY_SIDE = re.compile(r"attn\.(wkv|compressor\.|indexer\.compressor\.)")
ENTRY_SIDE = re.compile(r"attn\.indexer\.wk$")
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1


def model_config(name: str) -> ModelConfig:
    if name == "v4-flash":
        return parse_config(v4_flash_config(V4_RATIOS))
    if name == "v41-flash":
        return parse_config(v41_flash_config(1024))
    raise ValueError(f"--model {name!r}: expected v4-flash or v41-flash")


def linear_flops(model: nn.Module, config: ModelConfig) -> dict[str, float]:
    """Multiply-add FLOPs per row of the model's linears: ``own`` (a rank's own rows), ``key``
    (every row, on every rank), ``entry`` (per compressed entry of ratio 1, scaled by the
    layer's ratio by the caller: kept per layer)."""
    out = {"own": 0.0, "key": 0.0, "entry_per_ratio": 0.0}
    active = config.num_experts_per_tok / config.n_routed_experts
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "in_features") or weight is None or name.startswith("mtp"):
            continue
        flops = 2.0 * module.in_features * module.out_features
        if ENTRY_SIDE.search(name):
            ratio = config.compress_ratios[int(name.split(".")[1])]
            out["entry_per_ratio"] += flops / ratio
        elif KEY_SIDE.search(name):
            out["key"] += flops
        else:
            out["own"] += flops * (active if ".ffn.experts." in name else 1.0)
    return out


def exchange(config: ModelConfig, split: RowSplit, b: int = 2) -> dict[str, dict[str, int]]:
    """Per exchange (``hidden``, ``borders``), what the rank that receives most receives
    (bytes, padded as the all-gathers pad) and the most rows one rank computes keys for."""
    n, cp, layers = split.num_rows, split.cp, config.num_layers
    own = [r.long() for r in split.rows]
    width = max(len(r) for r in own)
    hidden = {"recv_bytes": layers * (cp - 1) * width * config.hidden_size * b, "key_rows": n}
    border, tail = reach(config)
    needs = [needed_rows(r, n, border, tail) for r in own]
    owner = torch.empty(n, dtype=torch.long)
    for rank, rows in enumerate(own):
        owner[rows] = rank
    sent = max(1, max(len(s) for s in border_sends(own, needs, owner)))
    recv = layers * (cp - 1) * sent * config.hidden_size * b
    for i in range(layers):
        ratio = config.compress_ratios[i]
        if ratio and config.owns_compressor(i):
            emitted = max(int(((rows + 1) % ratio == 0).sum()) for rows in own)
            recv += (cp - 1) * max(1, emitted) * (config.head_dim + config.index_head_dim) * b
    borders = {"recv_bytes": recv if cp > 1 else 0, "key_rows": max(len(x) for x in needs)}
    return {"hidden": hidden if cp > 1 else {"recv_bytes": 0, "key_rows": n}, "borders": borders}


def peak_activation_bytes(
    config: ModelConfig, own: int, n: int, cp: int, key_rows: int | None = None, b: int = 2
) -> int:
    """Counted live bytes of one rank at the attention of its most compressed top-k layer, the
    peak of a prefill step as the reference ops run it (``b``: bytes of the model dtype).

    Own rows: the mHC streams, the attention input, ``qr``, q (``b``) and the attention output
    (fp32), the index list ``[W + top-k]``, the step's metadata (window list and every kind's
    visible-entry list, int64, ``n / ratio`` wide), the indexer's q, weights and scores (fp32,
    ``n / ratio`` wide). Every key row (``key_rows``, default ``n``; CP only: at CP = 1 they
    are the own rows' own tensors): the gathered attention inputs; the window KV and the
    compressor's fp32 kv and score (``coff`` wide), and the V4 indexer compressor's."""
    c = config
    ratios = sorted({r for r in c.compress_ratios[: c.num_layers] if r})
    ratio = ratios[0]
    coff = 2 if (not c.is_v41 and ratio == 4) else 1
    visible = sum(n // r for r in ratios) * 8
    per_own = (
        c.hc_mult * c.hidden_size * b
        + c.hidden_size * b
        + c.q_lora_rank * b
        + c.num_heads * c.head_dim * (b + 4)
        + (c.sliding_window + c.index_topk) * 8
        + c.sliding_window * 8
        + visible
        + c.index_n_heads * (c.index_head_dim * b + 4)
        + (n // ratio) * 4
    )
    per_all = c.head_dim * b + 2 * coff * c.head_dim * 4
    if not c.is_v41:
        per_all += 2 * coff * c.index_head_dim * 4
    if cp > 1:
        per_all += c.hidden_size * b
    return own * per_own + (n if key_rows is None else key_rows) * per_all


def counted(config: ModelConfig, lengths: list[int], cps: list[int]) -> list[dict]:
    model = build_model(config, device="meta")
    per_row = linear_flops(model, config)
    shape = attention_shape(config)
    rows = []
    for n in lengths:
        for cp in cps:
            split = RowSplit.balanced(n, cp, config)
            att = [attention_flops(r, shape) for r in split.rows]
            own = max(len(r) for r in split.rows)
            entries = per_row["entry_per_ratio"] * n
            row = {
                "tokens": n,
                "cp": cp,
                "attention_tflops_max": max(att) / 1e12,
                "attention_spread": (max(att) - min(att)) / max(att),
                "own_linear_tflops_max": per_row["own"] * own / 1e12,
            }
            base = peak_activation_bytes(config, n, n, 1)
            for mode, ex in exchange(config, split).items():
                key = per_row["key"] * ex["key_rows"] + entries * (ex["key_rows"] / n)
                peak = peak_activation_bytes(config, own, n, cp, ex["key_rows"])
                row[mode] = {
                    "key_rows_max": ex["key_rows"],
                    "key_linear_tflops_max": key / 1e12,
                    "recv_gb": ex["recv_bytes"] / 1e9,
                    "peak_activation_gb": peak / 1e9,
                    "peak_ratio_to_cp1": peak / base,
                }
            rows.append(row)
    return rows


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measured_rank(rank, world_size, directory: str, tokens: int, single: bool, exchange: str):
    """One rank's (prefill seconds, peak resident MB above the pre-prefill resident)."""
    from deepinfer.engine.checkpoint.model_loader import load_model
    from deepinfer.engine.model.context_prefill import context_parallel_prefill
    from deepinfer.engine.testing.simple_runner import SimpleRunner
    from deepinfer.parallel import TorchDistributedComm

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)  # big blocks mmapped: freed ones leave the RSS
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 16)
    torch.set_num_threads(1)
    model = load_model(directory, dtype=torch.float32, progress=False).eval()
    prompt = torch.randint(3, 500, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = SimpleRunner(model, max_seqs=1, max_len=tokens)
    batch = runner.batch({0: prompt})
    split = None if single else RowSplit.balanced(tokens, world_size, model.config)
    comm = None if single else TorchDistributedComm()
    if comm is not None:
        comm.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size
    before = _memory_kb("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        if single:
            model(batch, runner.cache)
        else:
            context_parallel_prefill(model, runner.cache, batch, split, comm, exchange)
    seconds = time.perf_counter() - start
    return seconds, (_memory_kb("VmHWM") - before) / 1024


def measured(lengths: list[int], cps: list[int], timeout_s: float, exchange: str) -> list[dict]:
    from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
    from deepinfer.parallel import spawn

    raw = tiny_v4_config(sliding_window=128, index_topk=512, compress_ratios=[0, 4, 128, 4, 0])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(make_random_checkpoint(tmp, raw, quantized=False, seed=0))
        for n in lengths:
            for cp in cps:
                results = spawn(
                    _measured_rank, cp, directory, n, cp == 1, exchange, timeout_s=timeout_s
                )
                rows.append(
                    {
                        "tokens": n,
                        "cp": cp,
                        "seconds_max": max(s for s, _ in results),
                        "peak_mb_max": max(m for _, m in results),
                        "peak_mb_per_rank": [round(m, 1) for _, m in results],
                    }
                )
                print(rows[-1], flush=True)
    return rows


def peak_fit(rows: list[dict], targets: list[int]) -> dict:
    """Per CP, ``a + b N + c N^2`` fitted to the measured peaks, projected to ``targets``."""
    fits = {}
    for cp in sorted({r["cp"] for r in rows}):
        pts = [(r["tokens"], r["peak_mb_max"]) for r in rows if r["cp"] == cp]
        if len(pts) < 3:
            continue
        n = torch.tensor([p[0] for p in pts], dtype=torch.float64)
        y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
        design = torch.stack([torch.ones_like(n), n, n * n], dim=1)
        coef = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
        fits[cp] = {
            t: float(coef @ torch.tensor([1.0, t, t * t], dtype=torch.float64)) for t in targets
        }
    base = fits.get(1)
    ratios = {
        cp: {t: f[t] / base[t] for t in targets} for cp, f in fits.items() if base and cp != 1
    }
    return {"projected_peak_mb": fits, "ratio_to_cp1": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v4-flash")
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--measure-lengths", default="2048,4096,8192")
    p.add_argument("--exchange", default="borders", choices=("borders", "hidden"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [1, args.cp]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"environment": environment(), "model": args.model, "cp": args.cp}
    result["exchange"] = args.exchange
    result["counted"] = counted(model_config(args.model), lengths, cps)
    for row in result["counted"]:
        print(row, flush=True)
    if args.measure_lengths:
        result["measured"] = measured(
            [int(x) for x in args.measure_lengths.split(",")], cps, args.timeout, args.exchange
        )
        result["peak_fit"] = peak_fit(result["measured"], lengths)
        print(result["peak_fit"], flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
