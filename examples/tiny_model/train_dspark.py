"""Train the three DSpark draft stages of the tiny model on its frozen backbone.

    python -m examples.tiny_model.train_dspark --backbone out/backbone.pt --out out/dspark.pt

The target (``backbone.pt``, weights fake-quantised as exported; ``--target-numerics model``
adds the model's cache and indexer rounding) is frozen; only the draft stages ``mtp.*`` train (the
embedding and the LM head are the target's). Each step: one target prefill over ``--batch``
windows of ``--seq-len`` training tokens, then the draft block of every anchor position at
once (``dspark_training.teacher_forced_drafts``) and the DSpark loss. AdamW with linear
warmup and cosine decay, gradient clipping, fixed seed and data order. Writes ``--out``
(the ``mtp.*`` state dict in checkpoint names, fp32) and ``<out>.json`` (run facts).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import deepinfer.kernels as K

from . import dspark_training as dt
from . import tiny_common as tc
from .dense_attention import SequenceBlocks
from .training_ops import moe_twins, training_ops


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", required=True, help="backbone.pt from train.py")
    p.add_argument("--out", required=True, help="dspark.pt to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=2.0,
        help="time limit of the training loop (the LR schedule ends by then too)",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--off-path-weight",
        type=float,
        default=dt.LossWeights.off_path,
        help="loss weight of draft positions off the target's greedy path",
    )
    p.add_argument("--data-dir", default=str(tc.DATA_DIR))
    p.add_argument(
        "--confidence-target",
        choices=dt.CONFIDENCE_TARGETS,
        default=dt.LossWeights.confidence_target,
        help="tv: 1 - TV(p, q) (DeepSpec); greedy: draft argmax == target greedy token",
    )
    p.add_argument(
        "--target-numerics",
        choices=("float", "model"),
        default="float",
        help="model: also the model's cache and indexer rounding in the frozen target (weights "
        "are always fake-quantised; a dense target rounds no linear input); float by default",
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch", "log_every", "max_minutes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)}: expected > 0")
    if args.seq_len < 3:
        p.error(f"--seq-len = {args.seq_len}: expected >= 3")
    return args


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup to ``--lr`` over ``--warmup`` steps, then cosine down to 10% of it as
    ``progress`` goes from 0 to 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def schedule_progress(step: int, elapsed_s: float, args: argparse.Namespace) -> float:
    """How far the run is: by steps, or by ``--max-minutes`` if that comes first (then the
    cosine schedule still ends at its floor when the time is up, at some step < --steps)."""
    by_steps = (step - args.warmup) / max(1, args.steps - args.warmup)
    return max(by_steps, elapsed_s / (60 * args.max_minutes))


def load_models(args: argparse.Namespace):
    """(frozen fake-quantised target, trainable draft stages)."""
    target = tc.load_backbone(
        args.backbone, args.device, torch.float32, numerics=args.target_numerics
    )
    tc.fake_quantise_(target)
    target.eval().requires_grad_(False)
    # the stages are built (and initialised) unquantised, without activation rounding, so
    # gradients flow through them; their embedding and head are the target's
    draft = tc.build_model(args.device, torch.float32, include_mtp=True, seed=args.seed + 1).mtp
    dt.init_draft_heads_(draft)
    return target, draft


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    # the reference ops run on any device and have a backward; the Triton kernels do not
    K.set_accelerator("cpu")
    target, draft = load_models(args)
    # Training twins: the target's prefill attends densely per sequence (checked per call:
    # other shapes and the draft stages' window lists fall back to the gather twin, whose
    # backward scatters with atomics); both MoE stacks route with one host sync per layer.
    blocks = SequenceBlocks(args.seq_len, target.config.sliding_window)
    with training_ops(blocks, model=target, verify=True) as dense, moe_twins(draft):
        result = _train(args, target, draft)
    result["attention_twin_calls"] = {"dense": dense.num_dense, "gather": dense.num_fallback}
    return result


def _train(args: argparse.Namespace, target, draft) -> dict:
    params = dt.draft_parameters(draft)
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    weights = dt.LossWeights(
        off_path=args.off_path_weight, confidence_target=args.confidence_target
    )
    tokens = tc.load_tokens("train", args.data_dir)
    tb = tc.training_batch(target.config, args.batch, args.seq_len, args.device)
    history, started, step = [], time.perf_counter(), 0
    bar = tqdm(range(args.steps), desc="dspark", dynamic_ncols=True)
    for step in bar:
        windows = tc.batches(tokens, args.batch, args.seq_len, args.seed, step)
        ids = torch.from_numpy(windows[:, : args.seq_len]).to(args.device, non_blocking=True)
        tb.load(ids)
        taps, logits = dt.run_target(target, tb.batch, tb.cache, tb.metadata)
        out = dt.teacher_forced_drafts(
            draft, target.embed, target.head.weight, target.rope, taps, ids
        )
        loss, metrics = dt.dspark_loss(out, logits, weights)
        progress = schedule_progress(step, time.perf_counter() - started, args)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, progress, args)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            row = _log_row(step, metrics, time.perf_counter() - started)
            history.append(row)
            bar.set_postfix(loss=row["loss"], tau=row["tau"])
        if time.perf_counter() - started >= 60 * args.max_minutes and not last:
            history.append(_log_row(step, metrics, time.perf_counter() - started))
            tqdm.write(f"--max-minutes {args.max_minutes} reached at step {step + 1}")
            break
    seconds = time.perf_counter() - started
    return {"draft": draft, "steps_done": step + 1, "seconds": seconds, "history": history}


def _log_row(step: int, metrics: dict, seconds: float) -> dict:
    row = {k: round(float(v), 4) for k, v in metrics.items() if v.dim() == 0}
    row["agree"] = [round(float(a), 4) for a in metrics["agree"]]
    return {"step": step, "seconds": round(seconds, 1), **row}


def save(result: dict, args: argparse.Namespace) -> Path:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dt.draft_state_dict(result["draft"]), out)
    facts = {
        "args": vars(args),
        "steps_done": result["steps_done"],
        "train_seconds": round(result["seconds"], 1),
        "seconds_per_step": round(result["seconds"] / result["steps_done"], 3),
        "device": torch.cuda.get_device_name(0) if "cuda" in args.device else "cpu",
        "attention_twin_calls": result.get("attention_twin_calls"),
        "history": result["history"],
    }
    out.with_suffix(".json").write_text(json.dumps(facts, indent=1))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    result = train(args)
    path = save(result, args)
    final = result["history"][-1]
    print(
        f"dspark: {result['steps_done']} steps in {result['seconds']:.1f} s "
        f"({result['seconds'] / result['steps_done']:.3f} s/step); final loss "
        f"{final['loss']:.4f} (ce {final['ce']:.4f}, tv {final['tv']:.4f}, bce {final['bce']:.4f}),"
        f" on-greedy-path agreement per position {final['agree']} (tau {final['tau']:.3f});"
        f" wrote {path}"
    )


if __name__ == "__main__":
    main()
