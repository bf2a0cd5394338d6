"""Score the tiny model: validation NLL before and after quantisation, a bigram baseline, and
greedy completions through the engine.

Every model is scored on the same targets: the first ``--eval-tokens`` (262,144) tokens of
``data/validation.bin`` after its first, in windows of the training length (``--seq-len``,
512) that start at multiples of it, each window a fresh prefill from position 0.

- ``unquantised``: ``backbone.pt`` (fp32 weights, plain fp32 numerics, the reference ops);
- ``quantised``: the exported checkpoint loaded by the engine's own loader
  (``deepinfer.engine.checkpoint.load_model``): FP8 / FP4 weights and, as for every quantised
  checkpoint, the reference activation / KV rounding; ``--dtype`` activations (bf16); run by
  the reference ops (``--nll-accelerator cpu``, on ``--device`` tensors) unless told otherwise;
- ``bigram``: interpolated bigram ``l * c(a,b)/c(a) + (1 - l) * p(b)`` (add-one unigram)
  fitted on ``train.bin``, ``l`` chosen on the last 5% of train (fitted on the first 95%);
- five Python prompts completed greedily (64 new tokens) by ``deepinfer.engine.LLM``.

    python examples/tiny_model/evaluate.py --backbone OUT/backbone.pt --checkpoint OUT/checkpoint

Writes ``--out`` (default ``results.json`` next to the backbone) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tiny_common import (
    DATA_DIR,
    EVAL_TOKENS,
    TRAIN_SEQ_LEN,
    eval_windows,
    load_backbone,
    load_tokens,
    mean_nll,
)

import deepinfer.kernels as K

PROMPTS = (
    "def fibonacci(n):",
    "import os\n\ndef",
    "class Stack:",
    "for i in range(",
    "def read_file(path):",
)
BIGRAM_LAMBDAS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
TARGETS = {"max_quantisation_gap": 0.03, "min_gain_over_bigram": 0.35}


class Bigram:
    """Interpolated bigram over a vocabulary of ``vocab`` ids, counts kept sparse."""

    def __init__(self, tokens: np.ndarray, vocab: int) -> None:
        t = np.asarray(tokens, dtype=np.int64)
        self.vocab = vocab
        self.codes, self.pair_counts = np.unique(t[:-1] * vocab + t[1:], return_counts=True)
        self.prev_counts = np.bincount(t[:-1], minlength=vocab)
        unigram = np.bincount(t, minlength=vocab) + 1.0
        self.unigram = unigram / unigram.sum()

    def nll(self, prev: np.ndarray, nxt: np.ndarray, lam: float) -> float:
        """Mean NLL (nats) of ``nxt`` after ``prev`` (int arrays of equal length)."""
        codes = prev.astype(np.int64) * self.vocab + nxt
        at = np.searchsorted(self.codes, codes).clip(max=len(self.codes) - 1)
        pair = np.where(self.codes[at] == codes, self.pair_counts[at], 0)
        conditional = pair / np.maximum(self.prev_counts[prev], 1)
        p = lam * conditional + (1 - lam) * self.unigram[nxt]
        return float(-np.log(p).mean())


def bigram_nll(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray, vocab: int) -> dict:
    """Choose ``l`` on held-out train, refit on all of train, score (prev -> nxt)."""
    split = int(len(train) * 0.95)
    fit, held = Bigram(train[:split], vocab), np.asarray(train[split:], dtype=np.int64)
    scores = {lam: fit.nll(held[:-1], held[1:], lam) for lam in BIGRAM_LAMBDAS}
    best = min(scores, key=scores.get)
    nll = Bigram(train, vocab).nll(prev, nxt, best)
    return {"nll": nll, "lambda": best, "held_out_nll": {str(k): v for k, v in scores.items()}}


def quantised_nll(checkpoint: Path, windows, batch, device, dtype) -> float:
    from deepinfer.engine.checkpoint import load_model

    model = load_model(checkpoint, device=device, dtype=dtype, progress=False)
    return mean_nll(model, windows, batch, device)


def completions(checkpoint: Path, accelerator: str, dtype: str, max_tokens: int) -> list:
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), accelerator=accelerator, dtype=dtype, speculative_tokens=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [{"prompt": o.prompt, "completion": o.outputs[0].text} for o in outputs]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--accelerator", default="auto", help="engine backend of the completions")
    p.add_argument(
        "--nll-accelerator",
        default="cpu",
        help="kernels for the checkpoint's NLL (cpu = the reference ops, on --device tensors)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--seq-len", type=int, default=TRAIN_SEQ_LEN)
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-completions", action="store_true")
    return p.parse_args(argv)


def evaluate(args: argparse.Namespace) -> dict:
    device, timings = torch.device(args.device), {}
    validation = load_tokens("validation", args.data_dir)
    windows = eval_windows(validation, args.seq_len, args.eval_tokens)
    n_targets = windows.shape[0] * args.seq_len

    t0 = time.perf_counter()
    K.set_accelerator("cpu")  # the unquantised model runs the reference ops, as in training
    backbone = load_backbone(args.backbone, device)
    unquantised = mean_nll(backbone, windows, args.batch, device)
    del backbone
    timings["unquantised_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    K.set_accelerator(args.nll_accelerator)
    dtype = getattr(torch, args.dtype)
    quantised = quantised_nll(args.checkpoint, windows, args.batch, device, dtype)
    timings["quantised_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    train = load_tokens("train", args.data_dir)
    targets = np.asarray(validation[1 : n_targets + 1], dtype=np.int64)
    previous = np.asarray(validation[:n_targets], dtype=np.int64)
    bigram = bigram_nll(train, previous, targets, int(max(train.max(), validation.max())) + 1)
    timings["bigram_s"] = time.perf_counter() - t0

    # The NLL results are written before the completions, whose engine start may fail alone.
    results = summarise(args, unquantised, quantised, bigram, [], n_targets, timings)
    if args.no_completions:
        return results
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its cache from the free memory
    samples = completions(args.checkpoint, args.accelerator, args.dtype, args.max_new_tokens)
    timings["completions_s"] = time.perf_counter() - t0
    return summarise(args, unquantised, quantised, bigram, samples, n_targets, timings)


def summarise(args, unquantised, quantised, bigram, samples, n_targets, timings) -> dict:
    gap = (quantised - unquantised) / unquantised
    gain = 1 - quantised / bigram["nll"]
    results = {
        "eval_tokens": n_targets,
        "seq_len": args.seq_len,
        "nll": {"unquantised": unquantised, "quantised": quantised, "bigram": bigram["nll"]},
        "quantisation_gap": gap,
        "gain_over_bigram": gain,
        "targets": TARGETS,
        "passes": {
            "quantisation_gap": gap <= TARGETS["max_quantisation_gap"],
            "gain_over_bigram": gain >= TARGETS["min_gain_over_bigram"],
        },
        "bigram": bigram,
        "quantised_dtype": args.dtype,
        "completions": samples,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    out = args.out or args.backbone.parent / "results.json"
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print_table(results)
    print(f"wrote {out}")
    return results


def print_table(r: dict) -> None:
    nll = r["nll"]
    print(f"validation NLL per token over {r['eval_tokens']:,} tokens (windows of {r['seq_len']})")
    print(f"{'model':<14}{'NLL':>9}{'ppl':>10}")
    for name in ("unquantised", "quantised", "bigram"):
        print(f"{name:<14}{nll[name]:>9.4f}{np.exp(nll[name]):>10.2f}")
    print(
        f"quantisation gap {100 * r['quantisation_gap']:+.2f}% (target <= 3%: "
        f"{'pass' if r['passes']['quantisation_gap'] else 'FAIL'}); "
        f"below bigram {100 * r['gain_over_bigram']:.1f}% (target >= 35%: "
        f"{'pass' if r['passes']['gain_over_bigram'] else 'FAIL'})"
    )
    for s in r["completions"]:
        print("-" * 72)
        print(s["prompt"] + s["completion"])


if __name__ == "__main__":
    evaluate(parse_args())
