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

    python -m examples.tiny_model.evaluate --backbone OUT/backbone.pt --checkpoint OUT/checkpoint

(Without ``backbone.pt``: ``--unquantised-nll X --out FILE`` takes the unquantised NLL as given.)

Writes ``--out`` (default ``results.json`` next to the backbone) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import deepinfer.kernels as K

from .tiny_common import (
    DATA_DIR,
    EVAL_TOKENS,
    TRAIN_SEQ_LEN,
    eval_windows,
    load_backbone,
    load_tokens,
    mean_nll,
)

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
    p.add_argument("--backbone", type=Path, default=None, help="required without --unquantised-nll")
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
    p.add_argument(
        "--unquantised-nll",
        type=float,
        default=None,
        help="take the unquantised NLL as given (train.json's val_nll, same windows) instead of "
        "measuring it: for finishing a run whose backbone.pt is gone",
    )
    p.add_argument(
        "--completions-only",
        action="store_true",
        help="add the completions to an existing --out (written by an earlier run)",
    )
    args = p.parse_args(argv)
    if args.backbone is None and (args.unquantised_nll is None or args.out is None):
        p.error("--backbone is required unless both --unquantised-nll and --out are given")
    return args


def evaluate(args: argparse.Namespace) -> dict:
    """NLLs (results written after each one), then the completions unless told otherwise."""
    if args.completions_only:
        return add_completions(args, json.loads(_out_path(args).read_text()))
    device, timings = torch.device(args.device), {}
    validation = load_tokens("validation", args.data_dir)
    windows = eval_windows(validation, args.seq_len, args.eval_tokens)
    n_targets = windows.shape[0] * args.seq_len
    nll: dict[str, float | None] = {"unquantised": None, "quantised": None, "bigram": None}

    t0 = time.perf_counter()
    if args.unquantised_nll is not None:  # measured elsewhere (train.json): backbone.pt gone
        nll["unquantised"] = args.unquantised_nll
    else:
        K.set_accelerator("cpu")  # the unquantised model runs the reference ops, as in training
        backbone = load_backbone(args.backbone, device)
        with eval_twins(backbone, args.seq_len):
            nll["unquantised"] = mean_nll(backbone, windows, args.batch, device)
        del backbone
        timings["unquantised_s"] = time.perf_counter() - t0
    summarise(args, nll, {}, [], n_targets, timings)

    t0 = time.perf_counter()
    K.set_accelerator(args.nll_accelerator)
    dtype = getattr(torch, args.dtype)
    nll["quantised"] = quantised_nll(args.checkpoint, windows, args.batch, device, dtype)
    timings["quantised_s"] = time.perf_counter() - t0
    summarise(args, nll, {}, [], n_targets, timings)

    t0 = time.perf_counter()
    train = load_tokens("train", args.data_dir)
    targets = np.asarray(validation[1 : n_targets + 1], dtype=np.int64)
    previous = np.asarray(validation[:n_targets], dtype=np.int64)
    bigram = bigram_nll(train, previous, targets, int(max(train.max(), validation.max())) + 1)
    nll["bigram"] = bigram["nll"]
    timings["bigram_s"] = time.perf_counter() - t0
    # The NLL results are written before the completions, whose engine start may fail alone.
    results = summarise(args, nll, bigram, [], n_targets, timings)
    if args.no_completions:
        return results
    return add_completions(args, results)


def eval_twins(model, seq_len: int):
    """The training twins (dense attention over the eval windows' layout, grouped MoE): the
    same values as the reference ops, without the gather's ``[T, K, D]`` copy."""
    from .dense_attention import SequenceBlocks
    from .training_ops import training_ops

    return training_ops(SequenceBlocks(seq_len, model.config.sliding_window), model=model)


def add_completions(args: argparse.Namespace, results: dict) -> dict:
    """Greedy completions of :data:`PROMPTS` added to ``results`` (written at once)."""
    t0 = time.perf_counter()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its cache from the free memory
    samples = completions(args.checkpoint, args.accelerator, args.dtype, args.max_new_tokens)
    results["completions"] = samples
    results["timings_s"]["completions_s"] = round(time.perf_counter() - t0, 1)
    _write(args, results)
    for s in samples:
        print("-" * 72)
        print(s["prompt"] + s["completion"])
    return results


def _out_path(args: argparse.Namespace) -> Path:
    return args.out or args.backbone.parent / "results.json"


def _write(args: argparse.Namespace, results: dict) -> None:
    out = _out_path(args)
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


def summarise(args, nll, bigram, samples, n_targets, timings) -> dict:
    """The results so far (None for NLLs not measured yet), written to ``--out``."""
    unquantised, quantised, base = nll["unquantised"], nll["quantised"], nll["bigram"]
    gap = None if quantised is None else (quantised - unquantised) / unquantised
    gain = None if quantised is None or base is None else 1 - quantised / base
    results = {
        "eval_tokens": n_targets,
        "seq_len": args.seq_len,
        "nll": dict(nll),
        "quantisation_gap": gap,
        "gain_over_bigram": gain,
        "targets": TARGETS,
        "passes": {
            "quantisation_gap": None if gap is None else gap <= TARGETS["max_quantisation_gap"],
            "gain_over_bigram": None if gain is None else gain >= TARGETS["min_gain_over_bigram"],
        },
        "bigram": bigram,
        "quantised_dtype": args.dtype,
        "completions": samples,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    _write(args, results)
    print_table(results)
    return results


def print_table(r: dict) -> None:
    nll = r["nll"]
    print(f"validation NLL per token over {r['eval_tokens']:,} tokens (windows of {r['seq_len']})")
    print(f"{'model':<14}{'NLL':>9}{'ppl':>10}")
    for name in ("unquantised", "quantised", "bigram"):
        if nll[name] is not None:
            print(f"{name:<14}{nll[name]:>9.4f}{np.exp(nll[name]):>10.2f}")
    if r["gain_over_bigram"] is None:
        return
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
