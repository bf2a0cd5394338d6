"""The whole tiny-model pipeline on one GPU: backbone -> DSpark stages -> export -> evaluate.

    python -m examples.tiny_model.recipe --seed 0 --out runs/seed0 [--device cuda]

Phases (each a subprocess; wall times printed and written to ``OUT/recipe.json`` after each
phase, so a run stopped late keeps what it finished):

1. ``train.py``        the backbone (``OUT/backbone.pt``; ``OUT/train.json``, updated at every
   log step and final after the validation pass);
2. ``train_dspark.py`` the three draft stages on the frozen backbone (``OUT/dspark.pt``,
   ``OUT/dspark.json``), skipped with a message when that script is absent;
3. ``export.py``       the official-format checkpoint (``OUT/checkpoint/``);
4. ``evaluate.py``     NLL unquantised / quantised / bigram (``OUT/results.json``, written
   after each);
5. ``dspark_eval.py``  teacher-forced DSpark acceptance and calibration (ECE) of the exported
   checkpoint (``OUT/dspark_results.json``), when drafts were trained;
6. ``evaluate.py --completions-only``: greedy completions added to ``OUT/results.json``.

Step counts are explicit (``--steps``, ``--dspark-steps``): two runs with the same seed do
the same work step for step. ``--steps 0`` instead sizes the backbone from its measured step
time to fill ``--train-minutes`` (the count is recorded in ``train.json``).
``--max-train-minutes`` / ``--dspark-max-minutes`` are hard stops for a slow machine (a run
that hits one is no longer step-for-step comparable; ``train.json`` says where it stopped).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the defaults reproduce the shipped checkpoint's run (README "Results"; its times are in
# benchmarks/RESULTS.md)
DEFAULT_BATCH = 128
DEFAULT_STEPS = 538
DEFAULT_DSPARK_STEPS = 900


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="0: as many as fit --train-minutes"
    )
    p.add_argument("--train-minutes", type=float, default=4.5, help="backbone loop budget")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-train-minutes", type=float, default=6.0, help="hard stop")
    p.add_argument("--train-extra", default="", help="more train.py args (one string)")
    p.add_argument("--dspark-steps", type=int, default=DEFAULT_DSPARK_STEPS)
    p.add_argument("--dspark-max-minutes", type=float, default=6.0, help="hard stop")
    p.add_argument("--eval-tokens", type=int, default=262_144)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--skip-dspark", action="store_true")
    p.add_argument("--dspark-extra", default="", help="more train_dspark.py args (one string)")
    p.add_argument("--dspark-eval-extra", default="", help="more dspark_eval.py args")
    p.add_argument("--no-completions", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion")
    p.add_argument("--profile-steps", type=int, default=2, help="backbone steps profiled")
    return p.parse_args(argv)


class Phases:
    """Runs each phase as a subprocess, times it and records failures (a failed phase stops
    only the phases that need its output)."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.args, self.wall_s, self.failed = out, args, {}, []
        self.t_start = time.perf_counter()

    def run(self, name: str, argv: list[str]) -> bool:
        print(f"=== {name}: {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        module = f"{__package__}.{argv[0].removesuffix('.py')}"  # this package's script
        rc = subprocess.run(
            [sys.executable, "-m", module, *argv[1:]], cwd=HERE.parents[1]
        ).returncode
        self.wall_s[name] = round(time.perf_counter() - t0, 1)
        print(f"=== {name}: {self.wall_s[name]} s" + (f", FAILED (exit {rc})" if rc else ""))
        if rc:
            self.failed.append(name)
        self.write(self.args)
        return rc == 0

    def write(self, args: argparse.Namespace) -> dict:
        total = round(time.perf_counter() - self.t_start, 1)
        summary = {
            "finished": False,
            "seed": args.seed,
            "phases_s": {**self.wall_s, "total": total},
            "failed": self.failed,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        (self.out / "recipe.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def finish(self) -> dict:
        summary = self.write(self.args)
        summary["finished"] = True
        (self.out / "recipe.json").write_text(json.dumps(summary, indent=2) + "\n")
        times = summary["phases_s"].items()
        print("phase wall times (s): " + ", ".join(f"{k} {v}" for k, v in times))
        return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--device", args.device, "--data-dir", str(args.data_dir.resolve())]
    phases = Phases(out, args)
    if not phases.run("train_backbone", backbone_argv(args, out, common)):
        phases.finish()
        sys.exit(1)
    dspark = train_drafts(args, out, common, phases)
    export = ["export.py", "--backbone", str(out / "backbone.pt"), "--out", str(out / "checkpoint")]
    export += ["--seed", str(args.seed)] + (["--dspark", str(dspark)] if dspark else [])
    if phases.run("export", export):
        evaluate = ["evaluate.py", "--backbone", str(out / "backbone.pt")]
        evaluate += ["--checkpoint", str(out / "checkpoint"), "--out", str(out / "results.json")]
        evaluate += ["--seq-len", str(args.seq_len), "--eval-tokens", str(args.eval_tokens)]
        evaluate += [*common]
        evaluated = phases.run("evaluate", [*evaluate, "--no-completions"])
        if dspark is not None and (HERE / "dspark_eval.py").exists():
            cmd = ["dspark_eval.py", "--checkpoint", str(out / "checkpoint")]
            cmd += ["--out", str(out / "dspark_results.json"), "--seed", str(args.seed), *common]
            cmd += shlex.split(args.dspark_eval_extra)
            phases.run("dspark_eval", cmd)
        if evaluated and not args.no_completions:
            more = ["--completions-only", "--max-new-tokens", str(args.max_new_tokens)]
            phases.run("completions", [*evaluate, *more])
    summary = phases.finish()
    if phases.failed:
        sys.exit(1)
    return summary


def backbone_argv(args: argparse.Namespace, out: Path, common: list[str]) -> list[str]:
    train = ["train.py", "--seed", str(args.seed), "--out", str(out), "--steps", str(args.steps)]
    train += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    train += ["--train-minutes", str(args.train_minutes)]
    train += ["--max-train-minutes", str(args.max_train_minutes)]
    train += ["--eval-tokens", str(args.eval_tokens), "--profile-steps", str(args.profile_steps)]
    return [*train, *common, *shlex.split(args.train_extra)]


def train_drafts(args, out: Path, common: list[str], phases: Phases) -> Path | None:
    """The DSpark phase; returns ``dspark.pt`` or None (skipped or failed)."""
    if args.skip_dspark or not (HERE / "train_dspark.py").exists():
        print("=== train_dspark: skipped (--skip-dspark or train_dspark.py absent)")
        return None
    dspark = out / "dspark.pt"
    cmd = ["train_dspark.py", "--backbone", str(out / "backbone.pt"), "--out", str(dspark)]
    cmd += ["--seed", str(args.seed), "--max-minutes", str(args.dspark_max_minutes), *common]
    cmd += ["--steps", str(args.dspark_steps), *shlex.split(args.dspark_extra)]
    # a failed phase: export the backbone with untrained drafts
    return dspark if phases.run("train_dspark", cmd) else None


if __name__ == "__main__":
    main()
