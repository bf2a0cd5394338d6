"""Host time of a speculative step on the CPU, apart from the forwards a GPU replays as graphs.

The embedded tiny model speculates (``--k`` drafts, fixed or confidence-scheduled) with the
fixed-shape verification and draft forwards installed as the loader installs the captured
graphs on CUDA, here run eagerly (``capture=False``, as the CPU tests do). Every
``EngineCore.step`` of a greedy generation is timed, and so is every call of the two
fixed-shape forwards (``DecodeGraphs._forward``, ``DraftGraphs._forward``: on a GPU one graph
replay each) and of the model's eager forward (the prefill), by the main thread's CPU time
(one torch thread; far less moved by other processes on a shared machine than wall time,
which ``--wall`` takes instead). Host ms per step = (step time - forward time) over the steady
steps of a ``--decode-tokens`` run (a ``max_tokens=1`` run's steps, the prefill, subtracted).
Everything else the step does (scheduling, input preparation, verification bookkeeping, draft
picks, output processing, and the small sampling and acceptance ops that a GPU only launches)
counts as host time.
``aten_ops_per_step``: the aten ops the steady steps run outside the two forwards (each a
dispatch through torch; on a GPU those on device tensors are kernel launches or copies).
``--profile N`` prints the N most frequent of those ops and cProfile's top N functions of a
further run, by own and by cumulative time, with the two forwards' subtrees left out, and
writes the profile to ``bench-out/spec_host_profile.prof`` (``pstats``).

    python -m benchmarks.engine.spec_host_profile --batches 1,8,64 --out bench-out/host.json
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import environment, print_table, write_json
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.runner.draft_graphs import DraftGraphs
from deepinfer.sampling import SamplingParams
from deepinfer.spec import StepCostCurve

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "examples" / "tiny_model" / "checkpoint"
FORWARDS = (DecodeGraphs._forward, DraftGraphs._forward)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run outside the fixed-shape forwards (on a GPU: kernel launches or
    copies the host issues one by one), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.paused, self.ops = False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Clock:
    """Time of the engine steps and of the fixed-shape forwards inside them (``now``: the main
    thread's CPU time by default, robust to other processes on a shared machine, or wall time);
    the profiler and op counter, when on, are paused inside the forwards."""

    def __init__(self, now=time.thread_time) -> None:
        self.now = now
        self.steps, self.step_s, self.forward_s, self.depth = 0, 0.0, 0.0, 0
        self.profiler: cProfile.Profile | None = None
        self.counter: _OpCounter | None = None

    def wrap_step(self, inner):
        def step():
            start = self.now()
            try:
                return inner()
            finally:
                self.steps += 1
                self.step_s += self.now() - start

        return step

    def wrap_forward(self, inner):
        def forward(*args, **kwargs):
            self.depth += 1
            if self.depth > 1:  # inside a timed forward already
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.depth -= 1
            if self.profiler is not None:
                self.profiler.disable()
            if self.counter is not None:
                self.counter.paused = True
            start = self.now()
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                self.forward_s += self.now() - start
                if self.counter is not None:
                    self.counter.paused = False
                if self.profiler is not None:
                    self.profiler.enable()

        return forward


def _engine(args, batch: int, varlen: bool) -> LLM:
    curve = StepCostCurve.from_points([(1, 1.0), (512, 1.5)]) if varlen else None
    return LLM(str(args.model), accelerator="cpu", dtype="float32", block_size=16,
               max_model_len=args.decode_tokens + 64, max_num_seqs=batch,
               speculative_tokens=args.k, spec_varlen=varlen, spec_cost_curve=curve)  # fmt: skip


def _install(llm: LLM, batch: int, k: int, clock: _Clock) -> None:
    """The fixed-shape forwards, timed (what the loader installs as graphs on CUDA)."""
    runner = llm._core.executor
    graphs = DecodeGraphs(runner.model, runner.cache, max_batch_size=min(batch * (1 + k), 512),
                          max_context=1024, capture=False, speculative=k > 0)  # fmt: skip
    graphs._forward = clock.wrap_forward(graphs._forward)
    runner.graphs = graphs
    if k:  # --k 0: plain decode, no drafter
        drafts = DraftGraphs(runner.model, runner.cache, k, max_requests=batch, capture=False)
        drafts._forward = clock.wrap_forward(drafts._forward)
        runner.drafter.graphs = drafts
    # the eager forward of the prefill steps (on a GPU real work too, not host time)
    runner.model.forward_step = clock.wrap_forward(runner.model.forward_step)
    llm._core.step = clock.wrap_step(llm._core.step)


def _prompts(llm: LLM, batch: int) -> list[list[int]]:
    from benchmarks.engine.bench_spec import PROMPTS

    ids = [llm.get_tokenizer().encode(t) for t in PROMPTS]
    return [ids[i % len(ids)] for i in range(batch)]


def _run(llm, clock: _Clock, prompts, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = (clock.steps, clock.step_s, clock.forward_s)
    if clock.profiler is not None:
        clock.profiler.enable()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if clock.profiler is not None:
        clock.profiler.disable()
    after = (clock.steps, clock.step_s, clock.forward_s)
    return outputs, [a - b for a, b in zip(after, before)]


def measure(args, batch: int, varlen: bool) -> dict:
    clock = _Clock(time.perf_counter if args.wall else time.thread_time)
    llm = _engine(args, batch, varlen)
    _install(llm, batch, args.k, clock)
    prompts = _prompts(llm, batch)
    _run(llm, clock, prompts, args.decode_tokens)  # warm-up
    host = []
    for _ in range(args.repeats):
        _, (steps0, step0, fwd0) = _run(llm, clock, prompts, 1)
        outputs, (steps, step, fwd) = _run(llm, clock, prompts, args.decode_tokens)
        n = steps - steps0
        host.append(((step - fwd) - (step0 - fwd0)) / n * 1e3)
        forward_ms = ((fwd - fwd0) / n) * 1e3
    accepted = [o.metrics.mean_accepted_length or 1.0 for o in outputs]
    row = {
        "mode": "varlen" if varlen else "fixed", "batch": batch, "steady_steps": n,
        "host_ms_per_step": round(statistics.median(host), 2),
        "host_ms_runs": [round(h, 2) for h in host],
        "forward_ms_per_step": round(forward_ms, 2),
        "accept_len": round(statistics.mean(a for a in accepted if a is not None), 2),
    }  # fmt: skip
    if not args.no_ops:
        row["aten_ops_per_step"] = round(_ops_per_step(llm, clock, prompts, args), 1)
    if args.profile:
        clock.profiler = cProfile.Profile()
        _run(llm, clock, prompts, args.decode_tokens)
        _print_profile(clock.profiler, args.profile)
        clock.profiler = None
    return row


def _ops_per_step(llm, clock: _Clock, prompts, args) -> float:
    """Aten ops outside the forwards per steady step (a ``max_tokens=1`` run subtracted)."""
    counts = []
    for max_tokens in (1, args.decode_tokens):
        clock.counter = _OpCounter()
        with clock.counter:
            _, (steps, _, _) = _run(llm, clock, prompts, max_tokens)
        counts.append((steps, clock.counter.ops))
    clock.counter = None
    (steps0, ops0), (steps, ops) = counts
    if args.profile:
        print("aten ops per steady step:", {name: round((n - ops0[name]) / (steps - steps0), 1)
              for name, n in ops.most_common(args.profile)})  # fmt: skip
    return (sum(ops.values()) - sum(ops0.values())) / (steps - steps0)


def _print_profile(profiler: cProfile.Profile, top: int) -> None:
    out = Path("bench-out")  # ignored by git
    out.mkdir(exist_ok=True)
    profiler.dump_stats(out / "spec_host_profile.prof")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(EMBEDDED))
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--modes", default="fixed,varlen")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions")
    parser.add_argument("--no-ops", action="store_true", help="skip counting the aten ops")
    parser.add_argument("--wall", action="store_true", help="wall time, not the thread's CPU time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        measure(args, int(b), mode == "varlen")
        for mode in args.modes.split(",")
        for b in args.batches.split(",")
    ]
    print_table(rows, list(rows[0]))
    if args.out:
        write_json(args.out, {"environment": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
