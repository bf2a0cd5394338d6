"""Train the tiny V4.1 backbone through the engine's own model code.

Next-token cross entropy on ``data/train.bin`` through ``DeepseekV41Model.forward_step`` over
one fixed-shape ``ForwardBatch`` (every row a prefill from position 0; index lists built once).
AdamW (fp32 masters, TF32 matmuls), linear warm-up then cosine decay, gradient clipping,
auxiliary-loss-free expert balancing (the router bias moves against each expert's load), and
quantisation-aware training for the last ``--qat-fraction`` of the steps (the shipped FP8 / FP4
/ BF16 weights in forward and backward, updates applied to the fp32 masters). Seeded: torch,
numpy and the data order depend only on ``--seed``.

    python -m examples.tiny_model.train --device cuda --out runs/seed0 [--steps N] [--batch B]

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

import deepinfer.kernels as K

from .dense_attention import SequenceBlocks
from .quantise import quant_groups, restore, swap_in_quantised
from .tiny_common import (
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
from .training_ops import training_ops
from .training_run import CALIBRATION, StepBudget, TrainingRun, sync_time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=0, help="0: as many as fit --train-minutes (measured)"
    )
    p.add_argument("--train-minutes", type=float, default=4.0, help="loop budget of --steps 0")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=TRAIN_SEQ_LEN)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--qat-fraction", type=float, default=0.2)
    p.add_argument("--balance-rate", type=float, default=5e-3, help="router bias step size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS)
    p.add_argument("--max-train-minutes", type=float, default=None)
    p.add_argument(
        "--deterministic", action="store_true", help="CUDA: no atomics (much slower backward)"
    )
    p.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many steps from step 10"
    )
    p.add_argument(
        "--repeat-batch", action="store_true", help="train on step 0's windows every step (a check)"
    )
    p.add_argument(
        "--attention-twin",
        choices=("dense", "gather"),
        default="dense",
        help="sparse_mqa_sink training twin: per-sequence dense + mask, or the gather one",
    )
    p.add_argument(
        "--moe-twin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE forward with one host sync (else the reference loop over experts)",
    )
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> None:
    # The reference ops are differentiable plain torch; device kernels are inference-only.
    K.set_accelerator("cpu")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if torch.device(args.device).type == "cuda" and args.deterministic:
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
            # a histogram (bincount), not an index_add_: 16 cells under T * k atomic adds
            load.add_(torch.bincount(output[1].reshape(-1), minlength=load.shape[0]))

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
    t_start = time.perf_counter()
    setup(args)
    device = torch.device(args.device)
    tokens = load_tokens("train", args.data_dir)
    model = build_model(device, seed=args.seed)
    auto = args.steps <= 0
    if auto and args.warmup <= CALIBRATION[1]:
        raise ValueError(f"--warmup {args.warmup}: an automatic run needs > {CALIBRATION[1]}")
    opt, schedule = make_optimizer(model, args)
    balancer = ExpertBalancer(model, args.balance_rate)
    qat_groups = quant_groups(model, _quantised_config())
    tb = training_batch(model.config, args.batch, args.seq_len, device)
    params = [p for _, p in trainable_parameters(model)]
    t0 = sync_time(device)
    print(f"startup {t0 - t_start:.1f} s; {sum(p.numel() for p in params):,} trainable parameters")
    run = TrainingRun(args, device, t0, total=None if auto else args.steps)
    budget = StepBudget(run, device, t0 + 60 * args.train_minutes) if auto else None
    with twins(args, model, tb.cache.ring_size) as run.dense:
        while run.total is None or run.step < run.total:
            if budget is not None:
                budget.at_step(run.step)
            run.profiler.at_step(run.step)
            is_qat = run.total is not None and run.step >= run.qat_start
            loss = _train_step(model, tb, tokens, args, run.step, qat_groups if is_qat else None)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            run.after_step(loss, grad_norm, balancer.update(), schedule)
            if run.past_deadline():
                print(f"--max-train-minutes {args.max_train_minutes} reached at step {run.step}")
                break
    train_s = sync_time(device) - t0
    return finish(model, args, device, run, train_s, t0 - t_start)


def twins(args: argparse.Namespace, model, ring_size: int):
    """The training twins ``--attention-twin`` / ``--moe-twin`` choose (``training_ops``)."""
    blocks = SequenceBlocks(args.seq_len, ring_size) if args.attention_twin == "dense" else None
    return training_ops(blocks, model=model if args.moe_twin else None)


def _train_step(model, tb, tokens, args, step, qat_groups) -> torch.Tensor:
    """Forward + backward of step ``step``'s windows (QAT: at the rounded weights); returns
    the detached loss (on the device: no sync)."""
    data_step = 0 if args.repeat_batch else step
    windows = torch.from_numpy(batches(tokens, args.batch, args.seq_len, args.seed, data_step))
    if tb.batch.input_ids.is_cuda:
        windows = windows.pin_memory()
    windows = windows.to(tb.batch.input_ids.device, non_blocking=True)
    saved = swap_in_quantised(qat_groups) if qat_groups else None
    loss = token_nll(model, tb, windows)
    loss.backward()
    if saved is not None:
        restore(qat_groups, saved)
    return loss.detach()


def _twin_calls(dense) -> dict | None:
    return None if dense is None else {"dense": dense.num_dense, "gather": dense.num_fallback}


def _quantised_config() -> dict:
    from .tiny_common import hf_config

    return hf_config(quantized=True)


def finish(model, args, device, run: TrainingRun, train_s: float, startup_s: float) -> dict:
    run.bar.close()
    run.profiler.at_step(run.profiler.START + run.profiler.count)  # a run that ended inside
    model.eval()
    t0 = time.perf_counter()
    windows = eval_windows(load_tokens("validation", args.data_dir), args.seq_len, args.eval_tokens)
    with twins(args, model, model.config.sliding_window) as dense:
        val_nll = mean_nll(model, windows, args.batch, device)
        if dense is not None:
            dense.raise_on_violations()
    eval_s = time.perf_counter() - t0
    cuda = device.type == "cuda"
    facts = {
        "finished": True,
        "seed": args.seed,
        "steps": run.total,
        "steps_done": run.step,
        "qat_from_step": run.qat_start,
        "step_plans": run.plans,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": run.step * args.batch * args.seq_len,
        "startup_s": round(startup_s, 1),
        "train_s": round(train_s, 1),
        "val_nll": round(val_nll, 4),
        "val_tokens": int(windows.shape[0] * args.seq_len),
        "val_eval_s": round(eval_s, 1),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        if cuda
        else None,
        "attention_twin_calls": _twin_calls(run.dense),
        "args": {k: str(v) for k, v in vars(args).items()},
        "log": run.log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in facts.items() if k != "log"}
    save_backbone(model, args.out / "backbone.pt", extra=extra)
    (args.out / "train.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(
        f"trained {run.step} steps in {train_s:.1f} s "
        f"({facts['tokens_seen'] / train_s:,.0f} tok/s); validation NLL {val_nll:.4f} "
        f"over {facts['val_tokens']:,} tokens ({eval_s:.1f} s)"
    )
    return facts


if __name__ == "__main__":
    train(parse_args())
