"""The bookkeeping of one backbone training run: the step plan of an automatic run (timed
steps, then a total that fills the budget), the optional profiler, the log and ``train.json``
written as the run goes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

CALIBRATION = (3, 9)  # steps timed to size an automatic run (after warm-up, inside LR warm-up)
QAT_STEP_COST = 1.1  # a QAT step's time relative to a plain one (the weight rounding)


def planned_steps(done: int, step_s: float, left_s: float, qat_fraction: float) -> int:
    """Total steps so that the rest (``qat_fraction`` of the total at QAT cost) fits ``left_s``
    with a 5% margin."""
    per_step = step_s * (1 + (QAT_STEP_COST - 1) * qat_fraction)
    return done + max(1, int(0.95 * left_s / per_step))


class StepBudget:
    """Sizes an automatic run: times steps 3-8 and plans the total that fills the budget, then
    re-plans from the latest segment's pace at 1/4 and 1/2 of the plan and 5 steps into QAT
    (the LR schedule follows the plan; QAT's start stays put once passed)."""

    def __init__(self, run: TrainingRun, device, budget_end: float) -> None:
        self.run, self.device, self.budget_end = run, device, budget_end
        self.mark: tuple[int, float] | None = None
        self.checkpoints = {CALIBRATION[1]}

    def at_step(self, step: int) -> None:
        if step == CALIBRATION[0]:
            self.mark = (step, sync_time(self.device))
        if step not in self.checkpoints or self.mark is None:
            return
        now = sync_time(self.device)
        step_s = (now - self.mark[1]) / (step - self.mark[0])
        self.mark, left_s, run = (step, now), self.budget_end - now, self.run
        if run.qat_start is not None and step > run.qat_start:  # every step left is QAT
            run.set_total(step + max(1, int(0.97 * left_s / step_s)), step_s, keep_qat=True)
        else:
            run.set_total(planned_steps(step, step_s, left_s, run.args.qat_fraction), step_s)
        wanted = (run.total // 4, run.total // 2, run.qat_start + 5)
        self.checkpoints = {c for c in wanted if step < c < run.total}


class StepProfiler:
    """``torch.profiler`` over ``count`` steps from step 10 (after the step-time calibration);
    writes the op table (by device time, else CPU time) to ``path`` and prints its head."""

    START = CALIBRATION[1] + 1

    def __init__(self, count: int, path: Path) -> None:
        self.count, self.path, self.prof = count, path, None

    def at_step(self, step: int) -> None:
        if self.count <= 0:
            return
        if step == self.START:
            self.prof = torch.profiler.profile(record_shapes=False)
            self.prof.__enter__()
        elif step == self.START + self.count and self.prof is not None:
            self.prof.__exit__(None, None, None)
            cuda = torch.cuda.is_available()
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=key, row_limit=40)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(table)
            tqdm.write(table[:6000])
            self.prof = None


class TrainingRun:
    """Step counter, schedule facts and the log of one training run."""

    def __init__(self, args, device, t0: float, total: int | None) -> None:
        self.args, self.t0, self.step, self.log = args, t0, 0, []
        self.dense = None  # the DenseAttention twin in use (checked at each log step)
        self.loss_sum = torch.zeros((), device=device)
        self.last_log = (0, t0)
        self.plans: list[dict] = []
        self.total = self.qat_start = None
        self.bar = tqdm(total=total, desc="train", mininterval=2.0)
        if total is not None:
            self.set_total(total, None)
        minutes = args.max_train_minutes
        self.deadline = None if minutes is None else t0 + 60 * minutes
        self.profiler = StepProfiler(args.profile_steps, args.out / "profile.txt")

    def set_total(self, total: int, step_s: float | None, keep_qat: bool = False) -> None:
        self.total, self.args.steps = total, total  # the LR schedule reads args.steps
        if step_s is not None:  # a short automatic run (slow device) still decays
            self.args.warmup = min(self.args.warmup, max(CALIBRATION[1] + 1, total // 5))
        if not keep_qat:
            self.qat_start = total - int(round(self.args.qat_fraction * total))
        self.bar.total = total
        if step_s is not None:
            self.plans.append({"at_step": self.step, "step_s": round(step_s, 4), "total": total})
            tqdm.write(
                f"step {self.step}: {step_s:.3f} s/step -> {total} steps, QAT from {self.qat_start}"
            )

    def after_step(self, loss, grad_norm, imbalance, schedule) -> None:
        self.loss_sum += loss
        self.step += 1
        self.bar.update(1)
        if self.step % self.args.log_every == 0 or self.step == self.total or self.step <= 2:
            self.last_log = log_step(self, grad_norm, imbalance, schedule)
            self.loss_sum.zero_()

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


def log_step(run: TrainingRun, grad_norm, imbalance, schedule) -> tuple[int, float]:
    prev_step, prev_t = run.last_log
    now = sync_time(run.loss_sum.device)
    n, args = run.step - prev_step, run.args
    entry = {
        "step": run.step,
        "loss": round(float(run.loss_sum) / n, 4),
        "grad_norm": round(float(grad_norm), 3),
        "expert_max_over_mean": round(float(imbalance), 2),
        "lr": schedule.get_last_lr()[0],
        "tokens_per_s": round(n * args.batch * args.seq_len / (now - prev_t)),
        "steps_per_s": round(n / (now - prev_t), 3),
        "elapsed_s": round(now - run.t0, 1),
    }
    run.log.append(entry)
    run.bar.set_postfix(loss=entry["loss"], tok_s=entry["tokens_per_s"])
    tqdm.write(json.dumps(entry))
    if run.dense is not None:
        run.dense.raise_on_violations()
    write_progress(run)
    return run.step, now


def write_progress(run: TrainingRun) -> None:
    """``OUT/train.json`` so far (``"finished": false``): a run killed later keeps its log."""
    args = run.args
    facts = {"finished": False, "seed": args.seed, "steps": run.total, "steps_done": run.step}
    facts.update(batch=args.batch, seq_len=args.seq_len, step_plans=run.plans, log=run.log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.json").write_text(json.dumps(facts, indent=1) + "\n")


def sync_time(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
