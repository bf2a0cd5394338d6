"""Where an engine decode step spends its time: greedy decode of ``--batch`` copies of a prompt
for ``--tokens`` tokens through ``LLM.generate`` under cProfile, after a short warm-up; prints
the wall time and the functions with the most own time (torch ops appear as built-ins).

    python benchmarks/engine/profile_decode.py --accelerator cpu --batch 8 --tokens 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from common import environment, write_json  # noqa: E402

from deepinfer.engine.llm import LLM  # noqa: E402
from deepinfer.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "tiny_model" / "checkpoint"))
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default="def f(x):")
    p.add_argument("--top", type=int, default=15, help="functions printed")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    llm = LLM(args.model, accelerator=args.accelerator, dtype=args.dtype, speculative_tokens=0)
    prompts = [args.prompt] * args.batch
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(llm.generate, prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.top]
    top = [
        {"function": f"{Path(f).name}:{line}({name})", "calls": v[1], "own_s": round(v[2], 3)}
        for (f, line, name), v in rows
    ]
    print(f"{args.batch} x {args.tokens} tokens: {wall:.2f} s ({wall / args.tokens * 1e3:.1f} "
          f"ms per step, profiled)")  # fmt: skip
    for row in top:
        print(f"  {row['own_s']:8.3f} s  {row['calls']:7d}  {row['function']}")
    result = {"env": environment(), "args": vars(args), "wall_s": wall, "top": top}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
