"""How large a prefill chunk (``max_num_batched_tokens``) a long prompt needs to run near the
rate of an 8k prompt, counted.

A prompt of ``P`` tokens runs in chunks of ``C``; chunk ``i`` covers positions ``iC .. iC+C-1``.
Its time is counted per layer (``ModelShape.prefill_layer_work``):

- the GEMMs (projections, shared expert, router) at the FP8 rate, and the routed experts at
  the FP8 rate times the expert tiles' row utilisation: an expert gets ``m ~ Binomial(C, k/E)``
  rows of a chunk and runs ``ceil(m / 128)`` tiles of 128 rows, so small chunks leave tiles
  part-empty (C = 2,048 on V4-Flash: 48 rows per expert on average). 128 rows is the NVIDIA
  MoE kernel's tile from 96 rows per expert up; below that it takes 64- or 32-row tiles, whose
  own (lower) rate is not modelled, so the rows for chunks under ~4,096 tokens are rough;
- the attention core and the indexer scan at the bf16 rate, which grow with the position and
  not with the chunk size: no chunk size wins them back;
- ``--step-overhead-ms`` per step (host scheduling and launches, which a larger chunk spreads
  over more tokens).

The chunk's transient indexer scores (``[C, P/4]`` fp32 plus int64 candidates at the last
chunk; ``[C, P]`` in V4.1, whose indexers scan the ratio-1 cache) grow with ``C`` and with the
position, which bounds the chunk from above. V4.1 is counted with its own layer schedule
(every compressed layer attends the top-k; only the index sources scan).

    python -m benchmarks.engine.long_prefill --model v4-flash-dummy --prompt-len 131072 \\
        --chunks 2048,4096,8192,16384,32768 --step-overhead-ms 20
"""

from __future__ import annotations

import argparse
import math
from functools import cache

from benchmarks.common import print_table, write_json
from benchmarks.sweep.models import resolve_model
from benchmarks.sweep.roofline import H200, Device, ModelShape

TILE_ROWS = 128
REFERENCE_PROMPT = 8192  # the rate a long prompt is compared with: an 8k prompt in one step


@cache
def expert_tile_utilisation(chunk: int, experts_per_token: int, num_experts: int) -> float:
    """Rows per expert over the rows its 128-row tiles hold, expected over uniform routing:
    ``E[m] / (128 E[ceil(m / 128)])`` with ``m ~ Binomial(chunk, k / E)``."""
    p = experts_per_token / num_experts
    mean = chunk * p
    sd = math.sqrt(chunk * p * (1 - p))
    top = min(chunk, int(mean + 12 * sd) + 1)
    tiles, log_q = 0.0, math.log1p(-p)
    for m in range(1, top + 1):  # P(m) from the log-pmf: exact, no overflow at large chunks
        log_pmf = (math.lgamma(chunk + 1) - math.lgamma(m + 1) - math.lgamma(chunk - m + 1)
                   + m * math.log(p) + (chunk - m) * log_q)  # fmt: skip
        tiles += math.exp(log_pmf) * math.ceil(m / TILE_ROWS)
    return mean / (TILE_ROWS * tiles)


def chunk_seconds(shape: ModelShape, device: Device, start: int, end: int, step_s: float) -> dict:
    """Counted time of the chunk of positions ``start .. end - 1`` (see the module docstring)."""
    gemm = attention = routed = 0.0
    for layer, ratio in enumerate(shape.compress_ratios):
        work = shape.prefill_layer_work(ratio, start, end, layer)
        gemm += work["gemm"]
        attention += work["attention"] + work["indexer"]
    routed = shape.num_layers * (end - start) * 2 * shape.experts_per_token * shape.expert_params
    utilisation = expert_tile_utilisation(end - start, shape.experts_per_token, shape.num_experts)
    gemm_s = (gemm - routed) / device.flops + routed / (device.flops * utilisation)
    attention_s = attention / (device.attention_flops or device.flops)
    return {"start": start, "tokens": end - start, "gemm_s": gemm_s, "attention_s": attention_s,
            "seconds": gemm_s + attention_s + step_s, "expert_tiles_used": utilisation}  # fmt: skip


def prompt_rate(shape: ModelShape, device: Device, prompt_len: int, chunk: int, step_s: float):
    """(tokens/s of the whole prompt, per-chunk rows) for one prompt in chunks of ``chunk``."""
    rows = [chunk_seconds(shape, device, s, min(s + chunk, prompt_len), step_s)
            for s in range(0, prompt_len, chunk)]  # fmt: skip
    return prompt_len / sum(r["seconds"] for r in rows), rows


def _indexed_ratio(shape: ModelShape) -> int:
    """The compression ratio of the finest cache an indexer scans (V4: 4; V4.1: 1)."""
    if shape.index_source_layers is None:
        return 4
    layers = [i for i in shape.index_source_layers if i < shape.num_layers]
    return min(shape.compress_ratios[i] for i in layers) if layers else 4


def chunk_table(
    shape: ModelShape, device: Device, prompt_len: int, chunks: list[int], step_s: float
) -> list[dict]:
    """One row per chunk size: the long prompt's rate against an 8k prompt's in one step."""
    reference, _ = prompt_rate(shape, device, REFERENCE_PROMPT, REFERENCE_PROMPT, step_s)
    table = []
    for chunk in chunks:
        rate, rows = prompt_rate(shape, device, prompt_len, chunk, step_s)
        last = rows[-1]
        scores_gib = min(chunk, prompt_len) * (prompt_len // _indexed_ratio(shape)) * 12 / 2**30
        table.append({"chunk": chunk, "steps": len(rows), "tok/s": rate,
                      "of_8k_rate": rate / reference,
                      "last_chunk_of_8k": last["tokens"] / last["seconds"] / reference,
                      "expert_tiles_used": rows[0]["expert_tiles_used"],
                      "indexer_gib": scores_gib})  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v4-flash-dummy", choices=("v4-flash-dummy", "v41-flash-dummy"))  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="default: all of the model's")
    p.add_argument("--prompt-len", type=int, default=131072)
    p.add_argument("--chunks", default="2048,4096,8192,16384,32768,65536")
    p.add_argument("--step-overhead-ms", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.prompt_len < 1 or min(chunks) < 1:
        p.error(f"--prompt-len / --chunks: got {args.prompt_len} / {chunks}, expected >= 1")
    shape = ModelShape.from_config(resolve_model(args.model, args.layers).config)
    table = chunk_table(shape, H200, args.prompt_len, chunks, args.step_overhead_ms * 1e-3)
    print(f"{args.model}, {shape.num_layers} layers, {args.prompt_len} tokens, H200 rates, "
          f"{args.step_overhead_ms} ms per step")  # fmt: skip
    print_table(table, list(table[0]))
    write_json(args.out, {"args": vars(args), "rows": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
