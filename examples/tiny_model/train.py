"""Train the tiny V4.1 backbone through the engine's own model code.

Next-token cross entropy on ``data/train.bin`` through ``DeepseekV41Model.forward_step`` over
one fixed-shape ``ForwardBatch`` (every row a prefill from position 0; index lists built once).
AdamW (fp32 masters, TF32 matmuls), linear warm-up then cosine decay, gradient clipping,
auxiliary-loss-free expert balancing (the router bias moves against each expert's load), and
quantisation-aware training for the last ``--qat-fraction`` of the steps (the shipped FP8 / FP4
/ BF16 weights in forward and backward, updates applied to the fp32 masters). Seeded: torch,
numpy and the data order depend only on ``--seed``.

    python examples/tiny_model/train.py --device cuda --out runs/seed0 [--steps N] [--batch B]

Writes ``OUT/backbone.pt`` and ``OUT/train.json`` (losses, validation NLL, timings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from quantise import quant_groups, restore, swap_in_quantised
from tiny_common import (
    DATA_DIR,
    EVAL_TOKENS,
    TRAIN_SEQ_LEN,
    batches,
    build_model,
    eval_windows,
    load_tokens,
    mean_nll,
    save_backbone,
    token_nll,
    trainable_parameters,
    training_batch,
)
from tqdm import tqdm

import deepinfer.kernels as K


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=TRAIN_SEQ_LEN)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--qat-fraction", type=float, default=0.2)
    p.add_argument("--balance-rate", type=float, default=1e-3, help="router bias step size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS)
    p.add_argument("--max-train-minutes", type=float, default=None)
    p.add_argument("--no-deterministic", action="store_true", help="CUDA: allow atomics")
    p.add_argument(
        "--repeat-batch", action="store_true", help="train on step 0's windows every step (a check)"
    )
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> None:
    # The reference ops are differentiable plain torch; device kernels are inference-only.
    K.set_accelerator("cpu")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if torch.device(args.device).type == "cuda" and not args.no_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def make_optimizer(model, args):
    decay, no_decay = [], []
    for name, p in trainable_parameters(model):
        (decay if p.dim() >= 2 and "hc_" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = torch.device(args.device).type == "cuda"
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class ExpertBalancer:
    """Auxiliary-loss-free balancing: count each router's choices over a step (forward hooks,
    on the device), then move ``gate.bias`` by ``rate * sign(mean load - load)``."""

    def __init__(self, model, rate: float) -> None:
        self.rate = rate
        self.gates = [layer.ffn.gate for layer in model.layers if not layer.ffn.gate.is_hash]
        self.loads = [torch.zeros_like(g.bias) for g in self.gates]
        for gate, load in zip(self.gates, self.loads):
            gate.register_forward_hook(self._hook(load))

    @staticmethod
    def _hook(load):
        def count(module, inputs, output):
            ids = output[1].reshape(-1)
            load.index_add_(0, ids, torch.ones_like(ids, dtype=load.dtype))

        return count

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Apply and reset; returns the max/mean load ratio of the worst layer (device)."""
        worst = torch.zeros((), device=self.loads[0].device)
        for gate, load in zip(self.gates, self.loads):
            gate.bias += self.rate * torch.sign(load.mean() - load)
            worst = torch.maximum(worst, load.max() / load.mean().clamp_min(1))
            load.zero_()
        return worst


def train(args: argparse.Namespace) -> dict:
    setup(args)
    device = torch.device(args.device)
    tokens = load_tokens("train", args.data_dir)
    model = build_model(device, seed=args.seed)
    opt, schedule = make_optimizer(model, args)
    balancer = ExpertBalancer(model, args.balance_rate)
    qat_groups = quant_groups(model, _quantised_config())
    qat_start = args.steps - int(round(args.qat_fraction * args.steps))
    tb = training_batch(model.config, args.batch, args.seq_len, device)
    params = [p for _, p in trainable_parameters(model)]
    log, loss_sum, t0 = [], torch.zeros((), device=device), time.perf_counter()
    deadline = None if args.max_train_minutes is None else t0 + 60 * args.max_train_minutes
    bar = tqdm(range(args.steps), desc="train", mininterval=2.0)
    step, last_log = 0, (0, t0)
    for step in bar:
        data_step = 0 if args.repeat_batch else step
        windows = torch.from_numpy(batches(tokens, args.batch, args.seq_len, args.seed, data_step))
        windows = windows.pin_memory() if device.type == "cuda" else windows
        windows = windows.to(device, non_blocking=True)
        saved = swap_in_quantised(qat_groups) if step >= qat_start else None
        loss = token_nll(model, tb, windows)
        loss.backward()
        if saved is not None:
            restore(qat_groups, saved)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        imbalance = balancer.update()
        loss_sum += loss.detach()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            last_log = _log(
                log, bar, step, loss_sum, grad_norm, imbalance, schedule, args, last_log
            )
            loss_sum.zero_()
        if deadline is not None and time.perf_counter() > deadline:
            print(f"--max-train-minutes {args.max_train_minutes} reached after step {step + 1}")
            break
    train_s = _sync_time(device) - t0
    steps_done = step + 1
    return finish(model, args, device, log, steps_done, train_s, qat_start)


def _log(log, bar, step, loss_sum, grad_norm, imbalance, schedule, args, last_log):
    prev_step, prev_t = last_log
    now = _sync_time(loss_sum.device)
    n = step + 1 - prev_step
    entry = {
        "step": step + 1,
        "loss": round(float(loss_sum) / n, 4),
        "grad_norm": round(float(grad_norm), 3),
        "expert_max_over_mean": round(float(imbalance), 2),
        "lr": schedule.get_last_lr()[0],
        "tokens_per_s": round(n * args.batch * args.seq_len / (now - prev_t)),
        "steps_per_s": round(n / (now - prev_t), 3),
    }
    log.append(entry)
    bar.set_postfix(loss=entry["loss"], tok_s=entry["tokens_per_s"])
    tqdm.write(json.dumps(entry))
    return step + 1, now


def _sync_time(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _quantised_config() -> dict:
    from tiny_common import hf_config

    return hf_config(quantized=True)


def finish(model, args, device, log, steps_done, train_s, qat_start) -> dict:
    model.eval()
    t0 = time.perf_counter()
    windows = eval_windows(load_tokens("validation", args.data_dir), args.seq_len, args.eval_tokens)
    val_nll = mean_nll(model, windows, args.batch, device)
    eval_s = time.perf_counter() - t0
    facts = {
        "seed": args.seed,
        "steps": args.steps,
        "steps_done": steps_done,
        "qat_from_step": qat_start,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": steps_done * args.batch * args.seq_len,
        "train_s": round(train_s, 1),
        "val_nll": round(val_nll, 4),
        "val_tokens": int(windows.shape[0] * args.seq_len),
        "val_eval_s": round(eval_s, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        if device.type == "cuda"
        else None,
        "args": {k: str(v) for k, v in vars(args).items()},
        "log": log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_backbone(
        model, args.out / "backbone.pt", extra={k: v for k, v in facts.items() if k != "log"}
    )
    (args.out / "train.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(
        f"trained {steps_done} steps in {train_s:.1f} s "
        f"({facts['tokens_seen'] / train_s:,.0f} tok/s); validation NLL {val_nll:.4f} "
        f"over {facts['val_tokens']:,} tokens ({eval_s:.1f} s)"
    )
    return facts


if __name__ == "__main__":
    train(parse_args())
