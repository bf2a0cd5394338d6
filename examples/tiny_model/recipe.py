"""The whole tiny-model pipeline on one GPU: backbone -> DSpark stages -> export -> evaluate.

    python examples/tiny_model/recipe.py --seed 0 --out runs/seed0 [--device cuda]

Phases (each a subprocess; wall times printed and written to ``OUT/recipe.json``):

1. ``train.py``        the backbone (``OUT/backbone.pt``, ``OUT/train.json``);
2. ``train_dspark.py`` the three draft stages on the frozen backbone (``OUT/dspark.pt``),
   skipped with a message when that script is absent;
3. ``export.py``       the official-format checkpoint (``OUT/checkpoint/``);
4. ``evaluate.py``     NLL (unquantised / quantised / bigram) + completions (``OUT/results.json``);
5. ``dspark_eval.py``  teacher-forced DSpark acceptance and calibration
   (``OUT/dspark_results.json``), when present and drafts were trained.

Defaults fit the H200 budget (backbone <= 4.5 min, everything <= 7.5 min): by default the
backbone measures its step time on steps 3-8 and runs as many steps as fit ``--train-minutes``
(3.8; the count is recorded in ``train.json``: pass it back as ``--steps N`` to repeat a run
step for step); ``--max-train-minutes`` is a hard stop; ``--dspark-steps`` /
``--dspark-max-minutes`` size the drafts.
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
DEFAULT_BATCH = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=0, help="0: as many as fit --train-minutes")
    p.add_argument("--train-minutes", type=float, default=3.8, help="backbone loop budget")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-train-minutes", type=float, default=4.4, help="hard stop")
    p.add_argument("--dspark-steps", type=int, default=None, help="default: train_dspark's")
    p.add_argument("--dspark-max-minutes", type=float, default=1.5)
    p.add_argument("--eval-tokens", type=int, default=262_144)
    p.add_argument("--data-dir", type=Path, default=HERE / "data")
    p.add_argument("--skip-dspark", action="store_true")
    p.add_argument("--dspark-extra", default="", help="more train_dspark.py args (one string)")
    p.add_argument("--dspark-eval-extra", default="", help="more dspark_eval.py args")
    p.add_argument("--no-completions", action="store_true")
    return p.parse_args(argv)


class Phases:
    """Runs each phase as a subprocess, times it and records failures (a failed phase stops
    only the phases that need its output)."""

    def __init__(self, out: Path) -> None:
        self.out, self.wall_s, self.failed = out, {}, []
        self.t_start = time.perf_counter()

    def run(self, name: str, argv: list[str]) -> bool:
        print(f"=== {name}: {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, *argv], cwd=HERE).returncode
        self.wall_s[name] = round(time.perf_counter() - t0, 1)
        print(f"=== {name}: {self.wall_s[name]} s" + (f", FAILED (exit {rc})" if rc else ""))
        if rc:
            self.failed.append(name)
        return rc == 0

    def write(self, args: argparse.Namespace) -> dict:
        self.wall_s["total"] = round(time.perf_counter() - self.t_start, 1)
        summary = {
            "seed": args.seed,
            "phases_s": self.wall_s,
            "failed": self.failed,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        (self.out / "recipe.json").write_text(json.dumps(summary, indent=2) + "\n")
        print("phase wall times (s): " + ", ".join(f"{k} {v}" for k, v in self.wall_s.items()))
        return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--device", args.device, "--data-dir", str(args.data_dir.resolve())]
    phases = Phases(out)
    train = ["train.py", "--seed", str(args.seed), "--out", str(out), "--steps", str(args.steps)]
    train += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    train += ["--train-minutes", str(args.train_minutes)]
    train += ["--max-train-minutes", str(args.max_train_minutes)]
    train += ["--eval-tokens", str(args.eval_tokens), "--profile-steps", "2", *common]
    if not phases.run("train_backbone", train):
        phases.write(args)
        sys.exit(1)

    dspark = out / "dspark.pt"
    if args.skip_dspark or not (HERE / "train_dspark.py").exists():
        print("=== train_dspark: skipped (--skip-dspark or train_dspark.py absent)")
        dspark = None
    else:
        cmd = ["train_dspark.py", "--backbone", str(out / "backbone.pt"), "--out", str(dspark)]
        cmd += ["--seed", str(args.seed), "--max-minutes", str(args.dspark_max_minutes), *common]
        if args.dspark_steps is not None:
            cmd += ["--steps", str(args.dspark_steps)]
        cmd += shlex.split(args.dspark_extra)
        if not phases.run("train_dspark", cmd):
            dspark = None  # export the backbone with untrained drafts

    export = ["export.py", "--backbone", str(out / "backbone.pt"), "--out", str(out / "checkpoint")]
    export += ["--seed", str(args.seed)] + (["--dspark", str(dspark)] if dspark else [])
    if phases.run("export", export):
        evaluate = ["evaluate.py", "--backbone", str(out / "backbone.pt")]
        evaluate += ["--checkpoint", str(out / "checkpoint"), "--out", str(out / "results.json")]
        evaluate += ["--seq-len", str(args.seq_len), "--eval-tokens", str(args.eval_tokens)]
        evaluate += [*common] + (["--no-completions"] if args.no_completions else [])
        phases.run("evaluate", evaluate)
        if dspark is not None and (HERE / "dspark_eval.py").exists():
            cmd = ["dspark_eval.py", "--checkpoint", str(out / "checkpoint")]
            cmd += ["--out", str(out / "dspark_results.json"), "--seed", str(args.seed), *common]
            cmd += shlex.split(args.dspark_eval_extra)
            phases.run("dspark_eval", cmd)
    summary = phases.write(args)
    if phases.failed:
        sys.exit(1)
    return summary


if __name__ == "__main__":
    main()
