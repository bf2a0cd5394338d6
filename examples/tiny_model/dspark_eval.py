"""Measure the DSpark drafts of the tiny model: greedy acceptance and confidence calibration.

    python -m examples.tiny_model.dspark_eval --checkpoint examples/tiny_model/checkpoint \\
        [--backbone out/backbone.pt --dspark out/dspark.pt] --out out/dspark_results.json

For ``--anchors`` windows of ``--prefix-len`` validation tokens (random offsets, fixed seed),
the last token of a window is the anchor ``x[p+1]``: the drafts are proposed by
``DSparkDraft.propose`` (greedy; each draft's Markov previous token is the previous draft) from
the taps of positions ``0 .. p``, and compared with the target's own greedy continuation of
``K`` tokens after the window (batched prefill + ``K - 1`` decode steps). Accepted drafts = the
longest prefix of drafts equal to the target's tokens; accepted length per verify step =
accepted drafts + 1 (the bonus token). Calibration: ``c_i = sigmoid(confidence logit)`` is
the probability that draft ``i`` is accepted given drafts ``< i`` were; ECE (10 equal-width
bins) and Brier score over the positions whose earlier drafts were all accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.testing.simple_runner import SimpleRunner

NUM_BINS = 10


# -- drafting and verifying ------------------------------------------------------------------


@torch.no_grad()
def draft_and_verify(model: nn.Module, prefixes: torch.Tensor, *, chunk: int = 128) -> dict:
    """prefixes ``[N, P]`` int64 (``P >= 2``) -> ``drafts``, ``greedy`` ``[N, K]`` int64 and
    ``confidence_logits`` ``[N, K]`` fp32 (CPU tensors), in chunks of ``chunk`` anchors."""
    parts = [_draft_chunk(model, prefixes[i : i + chunk]) for i in range(0, len(prefixes), chunk)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _draft_chunk(model: nn.Module, prefixes: torch.Tensor) -> dict:
    config = model.config
    k = config.dspark_block_size
    n, length = prefixes.shape
    device = model.embed.weight.device
    runner = SimpleRunner(
        model, max_seqs=n, max_len=length + k, block_size=128, max_draft=k, device=device
    )
    model.mtp.allocate(runner.cache)
    batch = runner.batch({s: prefixes[s].tolist() for s in range(n)})
    last_rows = torch.arange(1, n + 1, device=device) * length - 1
    out = model.forward_step(dataclasses.replace(batch, logits_indices=last_rows), runner.cache)
    runner.lengths = dict.fromkeys(range(n), length)
    # seed the draft windows with the taps of positions 0 .. p (p = length - 2)
    seeded = batch.positions <= length - 2
    token_slots = batch.state_slots.long().repeat_interleave(length)
    model.mtp.seed(
        out.taps[seeded], batch.positions[seeded], token_slots[seeded], runner.cache, model.rope
    )
    anchors = prefixes[:, -1].to(device)
    proposal = model.mtp.propose(
        anchors,
        torch.full((n,), length - 2, dtype=torch.long, device=device),
        torch.arange(n, device=device),
        runner.cache,
        model.embed,
        model.head.weight,
        model.rope,
    )
    greedy = [out.logits.argmax(-1)]
    for _ in range(k - 1):
        logits = runner.step({s: [int(t)] for s, t in enumerate(greedy[-1].tolist())})
        greedy.append(torch.stack([logits[s][-1] for s in range(n)]).argmax(-1))
    return {
        "drafts": proposal.tokens.cpu(),
        "greedy": torch.stack(greedy, 1).cpu(),
        "confidence_logits": proposal.confidence_logits.float().cpu(),
    }


# -- metrics ---------------------------------------------------------------------------------


def calibration(confidence: torch.Tensor, accepted: torch.Tensor, num_bins: int = NUM_BINS):
    """ECE over ``num_bins`` equal-width bins and the Brier score of probabilities
    ``confidence`` ``[M]`` against 0/1 outcomes ``accepted`` ``[M]``; (None, None) if empty."""
    if confidence.numel() == 0:
        return None, None
    c, y = confidence.double(), accepted.double()
    bins = (c * num_bins).long().clamp(0, num_bins - 1)
    sum_c = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, c)
    sum_y = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, y)
    # sum_b (n_b / M) * abs(mean c - mean y) over bin b = sum_b abs(sum c - sum y) / M
    ece = ((sum_c - sum_y).abs().sum() / c.numel()).item()
    brier = ((c - y) ** 2).mean().item()
    return ece, brier


def acceptance_metrics(drafts, greedy, confidence_logits) -> dict:
    """Acceptance and calibration of ``[N, K]`` drafts against the target's greedy tokens."""
    match = drafts == greedy
    accepted = match.long().cumprod(1).bool()  # draft i accepted (all earlier ones were)
    reached = torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], 1)
    num_accepted = accepted.sum(1).double()
    conf = torch.sigmoid(confidence_logits.double())
    per_position = []
    for i in range(drafts.shape[1]):
        mask = reached[:, i]
        ece, brier = calibration(conf[mask, i], accepted[mask, i])
        per_position.append(
            {
                "position": i,
                "reached": int(mask.sum()),
                "acceptance_given_reached": _ratio(accepted[:, i].sum(), mask.sum()),
                "acceptance": accepted[:, i].double().mean().item(),
                "mean_confidence_given_reached": conf[mask, i].mean().item()
                if mask.any()
                else None,
                "ece": ece,
                "brier": brier,
            }
        )
    ece, brier = calibration(conf[reached], accepted[reached])
    survival = conf.cumprod(1).sum(1)  # the scheduler's expected accepted drafts
    return {
        "num_anchors": int(drafts.shape[0]),
        "block_size": int(drafts.shape[1]),
        "mean_accepted_drafts": num_accepted.mean().item(),
        "accepted_length_per_verify_step": num_accepted.mean().item() + 1.0,
        "accepted_drafts_histogram": torch.bincount(
            accepted.sum(1), minlength=drafts.shape[1] + 1
        ).tolist(),
        "ece": ece,
        "brier": brier,
        "predicted_mean_accepted_drafts": survival.mean().item(),
        "per_position": per_position,
    }


def _ratio(num, den) -> float | None:
    return None if int(den) == 0 else float(num) / float(den)


# -- anchors and models ----------------------------------------------------------------------


def sample_prefixes(tokens: np.ndarray, num: int, length: int, seed: int) -> torch.Tensor:
    """``[num, length]`` int64 windows of ``tokens`` at random offsets (fixed ``seed``)."""
    if len(tokens) < length + 1:
        raise ValueError(f"{len(tokens)} tokens: need at least prefix length + 1 = {length + 1}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, size=num)
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))


def load_checkpoint_with_drafts(directory, device, dtype: torch.dtype) -> nn.Module:
    """The exported checkpoint through the engine's loader, with the draft stages."""
    from deepinfer.engine.checkpoint import bind_engram_from_tokenizer
    from deepinfer.engine.checkpoint.loader import load_into
    from deepinfer.engine.model.config_parsing import load_config
    from deepinfer.engine.model.model import build_model

    config = load_config(directory)
    model = build_model(config, device=device, dtype=dtype, include_mtp=True)
    load_into(model, directory, config=config, progress=False)
    bind_engram_from_tokenizer(model, directory)
    return model.eval()


def load_unquantised_pair(backbone, dspark, device) -> nn.Module:
    """``backbone.pt`` + ``dspark.pt`` as trained (fp32, no quantisation)."""
    from . import tiny_common as tc

    model = tc.load_backbone(backbone, device, torch.float32, include_mtp=True)
    state = torch.load(dspark, map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m.startswith("mtp.")]
    if missing or unexpected:
        raise ValueError(f"{dspark}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval().requires_grad_(False)


def evaluate(model: nn.Module, prefixes: torch.Tensor, chunk: int) -> dict:
    started = time.perf_counter()
    raw = draft_and_verify(model, prefixes, chunk=chunk)
    metrics = acceptance_metrics(raw["drafts"], raw["greedy"], raw["confidence_logits"])
    metrics["seconds"] = round(time.perf_counter() - started, 1)
    return metrics


# -- script ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    from . import tiny_common as tc

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="exported checkpoint directory (engine loader)")
    p.add_argument("--backbone", help="backbone.pt (with --dspark: the unquantised pair)")
    p.add_argument("--dspark", help="dspark.pt from train_dspark.py")
    p.add_argument("--out", default="dspark_results.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--accelerator", default=None, help="kernel backend (default: detect)")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=128, help="anchors per batched pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(tc.DATA_DIR))
    args = p.parse_args(argv)
    if not args.checkpoint and not (args.backbone and args.dspark):
        p.error("give --checkpoint and/or both --backbone and --dspark")
    if bool(args.backbone) != bool(args.dspark):
        p.error("--backbone and --dspark go together")
    if args.prefix_len < 2 or args.anchors <= 0 or args.chunk <= 0:
        p.error("expected --prefix-len >= 2, --anchors > 0, --chunk > 0")
    return args


def print_table(results: dict) -> None:
    for name, m in results["models"].items():
        print(
            f"\n{name}: {m['num_anchors']} anchors, K = {m['block_size']}: accepted drafts "
            f"{m['mean_accepted_drafts']:.3f}, accepted length per verify step "
            f"{m['accepted_length_per_verify_step']:.3f}; ECE {m['ece']:.4f}, Brier "
            f"{m['brier']:.4f}; confidence-predicted accepted drafts "
            f"{m['predicted_mean_accepted_drafts']:.3f}"
        )
        print("  pos  reached  P(acc|reached)  P(acc)  mean conf    ECE   Brier")
        for r in m["per_position"]:
            cond = r["acceptance_given_reached"]
            conf = r["mean_confidence_given_reached"]
            print(
                f"  {r['position']:>3}  {r['reached']:>7}  {_fmt(cond):>14}  {r['acceptance']:.3f}"
                f"  {_fmt(conf):>9}  {_fmt(r['ece']):>5}  {_fmt(r['brier']):>6}"
            )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    with torch.no_grad():  # scoped: a caller's (or a test session's) grad mode stays as it was
        return _main(args)


def _main(args: argparse.Namespace) -> dict:
    from . import tiny_common as tc

    K.set_accelerator(args.accelerator)
    tokens = tc.load_tokens("validation", args.data_dir)
    prefixes = sample_prefixes(tokens, args.anchors, args.prefix_len, args.seed)
    results = {"args": vars(args), "models": {}}
    if args.checkpoint:
        model = load_checkpoint_with_drafts(
            args.checkpoint, args.device, getattr(torch, args.dtype)
        )
        results["models"]["exported checkpoint"] = evaluate(model, prefixes, args.chunk)
        del model
    if args.backbone:
        K.set_accelerator("cpu")  # fp32 dense weights: the reference ops, on any device
        model = load_unquantised_pair(args.backbone, args.dspark, args.device)
        results["models"]["unquantised (backbone.pt + dspark.pt)"] = evaluate(
            model, prefixes, args.chunk
        )
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    return results


if __name__ == "__main__":
    main()
