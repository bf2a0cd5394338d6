"""Structured-output costs on a 129,280-token vocabulary (CPU work: xgrammar compile + masks).

The vocabulary is synthetic (no download): the 256 single bytes, then random byte-level
"subwords" of 2-10 characters drawn from English-like letter, digit, space and punctuation
frequencies, up to 129,280 entries, token 0 the stop token. For each grammar of the test
corpus (30 JSON schemas, regexes, EBNF) it reports the compile time (cache off) and, while
sampling from random logits under the grammar, the per-token cost of ``fill_bitmask`` (mask
fill) and of ``accept_token``. Prints a table; ``--out`` writes JSON.

    python -m benchmarks.sampling.bench_grammar --out benchmarks/sampling/grammar.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import xgrammar as xgr

from deepinfer.sampling import (
    GrammarCompilerService,
    GrammarSpec,
    SamplingParams,
    StructuredOutputState,
    allocate_token_bitmask,
    sample,
)
from deepinfer.sampling.testing_grammars import EBNF_GRAMMARS, JSON_SCHEMAS, REGEXES

_ALPHABET = (
    "etaoinshrdlucmfwypvbgkjqxz" * 4 + "ETAOINSHRD" + "0123456789" + "  " * 6 + '.,:;"{}[]-_'
)


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab = [b"<eos>"] + [bytes([b]) for b in range(256)]
    seen = set(vocab)
    while len(vocab) < size:
        piece = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(2, 10))).encode()
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def _specs() -> list[tuple[str, GrammarSpec]]:
    specs = [(f"json[{i}]", GrammarSpec("json", json.dumps(s))) for i, s in enumerate(JSON_SCHEMAS)]
    specs += [(f"regex[{i}]", GrammarSpec("regex", r)) for i, r in enumerate(REGEXES)]
    specs += [(f"ebnf[{i}]", GrammarSpec("ebnf", g)) for i, (g, _) in enumerate(EBNF_GRAMMARS)]
    return specs


def _mask_costs(compiled, vocab_size: int, seed: int, max_tokens: int) -> tuple[list, list]:
    state = StructuredOutputState(compiled)
    bitmask = allocate_token_bitmask(1, vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.0)]  # random logits each step: argmax is random
    fill_us, accept_us = [], []
    for step in range(max_tokens):
        if state.is_terminated():
            break
        t0 = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        fill_us.append((time.perf_counter() - t0) * 1e6)
        logits = torch.randn(1, vocab_size, generator=gen) * 2.0
        token = sample(logits, params, [step], bitmask=bitmask).token_ids.item()
        t0 = time.perf_counter()
        if not state.accept_token(token):
            raise RuntimeError("sampled a token the grammar rejects")
        accept_us.append((time.perf_counter() - t0) * 1e6)
    return fill_us, accept_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    vocab = synthetic_vocab(args.vocab)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    rows = {}
    print(f"vocab {len(vocab)} (synthetic), compile cache off, {args.threads} compile threads")
    print(f"{'grammar':10s} {'compile ms':>11s} {'tokens':>7s} {'fill us p50':>12s} "
          f"{'fill us p90':>12s} {'accept us p50':>14s}")  # fmt: skip
    for i, (name, spec) in enumerate(_specs()):
        service = GrammarCompilerService(info, max_threads=args.threads, timeout_s=600)
        service._compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = service.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        service.shutdown()
        fill, accept = _mask_costs(compiled, info.vocab_size, i, args.max_tokens)
        fill_sorted = sorted(fill)
        rows[name] = {
            "compile_ms": compile_ms,
            "tokens": len(fill),
            "fill_us_median": statistics.median(fill),
            "fill_us_p90": fill_sorted[(9 * len(fill)) // 10],
            "accept_us_median": statistics.median(accept),
        }
        r = rows[name]
        print(f"{name:10s} {compile_ms:11.1f} {r['tokens']:7d} {r['fill_us_median']:12.1f} "
              f"{r['fill_us_p90']:12.1f} {r['accept_us_median']:14.1f}")  # fmt: skip
    summary = {
        key: statistics.median(r[key] for r in rows.values())
        for key in ("compile_ms", "fill_us_median", "fill_us_p90", "accept_us_median")
    }
    print("median over grammars:", {k: round(v, 1) for k, v in summary.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": len(vocab), "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
