"""Time to first token of one long prompt through ``LLM`` with and without context parallelism.

Two engines of the same ``--dp`` ranks: ``context_parallel_size=1`` (the prompt is prefilled
by the one rank that owns it, in chunks of ``max_num_batched_tokens``) and ``--cp`` (its owner's
CP group prefills it, each rank computing its balanced share). Each is warmed up with a short
prompt, then every ``--lengths`` prompt (random token ids) is generated alone with
``max_tokens=1``, ``--repeats`` times; the median wall time is its time to first token. Prints
a table and writes the JSON (``--out``).

    python -m benchmarks.parallel.bench_context_llm --model v4-flash-dummy --layers 8 \\
        --dp 2 --cp 2 --lengths 8192,32768 --out bench-out/context_llm.json
    python -m benchmarks.parallel.bench_context_llm --smoke --out bench-out/context_llm.json

``--smoke``: the embedded tiny model on CPU processes, short prompts, seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import environment, write_json
from benchmarks.sweep.models import resolve_model
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.sampling import SamplingParams


def ttft(llm: LLM, length: int, vocab: int, repeats: int) -> float:
    """Median seconds to generate one token after a ``length``-token prompt, alone."""
    times = []
    for seed in range(repeats):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(10, vocab - 10, (length,), generator=g).tolist()
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args, cp: int, source, lengths: list[int]) -> dict[int, float]:
    options = dict(data_parallel_size=args.dp, context_parallel_size=cp, speculative_tokens=0)
    options.update(cp_min_tokens=args.cp_min_tokens, max_model_len=max(lengths) + 8)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.smoke:
        options.update(accelerator="cpu", dtype="float32")
    else:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(source.path, load_format=source.load_format, **options)
    try:
        vocab = load_config(source.path).vocab_size
        ttft(llm, min(lengths), vocab, 1)  # warm-up (and, with CP, the groups' first chunk)
        return {n: ttft(llm, n, vocab, args.repeats) for n in lengths}
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="v4-flash-dummy")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=None, help="default: --dp")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--cp-min-tokens", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.layers, args.lengths, args.repeats = "tiny", None, "300,600", 1
        args.cp_min_tokens = 64
    cp = args.cp or args.dp
    lengths = [int(n) for n in args.lengths.split(",")]
    source = resolve_model(args.model, args.layers)
    rows = {c: run(args, c, source, lengths) for c in (1, cp)}
    print(f"{source.label}; {args.dp} DP ranks; time to first token, median of {args.repeats}")
    print(f"{'tokens':>8} {'CP=1 s':>10} {f'CP={cp} s':>10} {'speed-up':>9}")
    for n in lengths:
        print(f"{n:>8} {rows[1][n]:>10.3f} {rows[cp][n]:>10.3f} {rows[1][n] / rows[cp][n]:>8.2f}x")
    payload = {"env": environment(), "model": source.label, "dp": args.dp, "cp": cp}
    payload.update(max_num_batched_tokens=args.max_num_batched_tokens, repeats=args.repeats)
    payload["ttft_s"] = {str(c): {str(n): t for n, t in r.items()} for c, r in rows.items()}
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
