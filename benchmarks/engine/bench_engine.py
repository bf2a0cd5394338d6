"""End-to-end engine throughput through ``LLM.generate`` on a dummy-weight V4-Flash-shaped model.

The model is the published V4-Flash shape (hidden 4096, 64 heads of 512, 256 FP4 experts top-6,
FP8 128x128 blocks; ``--model v41-flash-dummy``: V4.1-Flash's, as the sweep builds it) with
``--layers`` backbone layers (the real model has 43 and does not fit one H200 with its 160 GB of
weights); results are labelled with the layer count. Weights are random
(``load_format="dummy"``). The engine keeps its default token budget per step unless
``--max-num-batched-tokens`` is given. Prefill: ``--prefill-prompts`` prompts of ``--prompt-len``
tokens (or ``--prefill-shapes 8x1024,1x8192,1x32768``) with ``max_tokens=1``, timed by
:func:`benchmarks.timing.time_call` exactly as the sweep (``run_sweep.sh``) times its prefill
points: one untimed call, median of ``--repeats``. Decode: batches of prompts of 128 tokens
generating ``--decode-tokens`` tokens; decode throughput = batch x (decode tokens - 1) / (time -
time of the same batch with ``max_tokens=1``), each time the median of ``--decode-repeats`` calls
after an untimed one (the JSON keeps every call's seconds).

Each decode row carries its roofline: the bytes one step must read at least (every non-expert
weight except the embedding, plus the routed experts a batch of that size touches in
expectation, ``E (1 - (1 - k/E)^B)`` per layer; KV reads of 128-token contexts are negligible)
over the copy rate measured in the same run. ``--reference-ops-batches`` then repeats decode
rows with ``DEEPINFER_REFERENCE_OPS=1`` (every op's plain-PyTorch reference on the GPU, the
engine's reference-op baseline) in the same process and model. ``--batch-invariant`` repeats
the prefill rows and, eagerly, the decode rows with ``DEEPINFER_BATCH_INVARIANT=1`` (the cost of
the mode: compare with the eager rows without it). ``--modes graphs,eager`` runs
the decode rows with the engine's decode CUDA graphs and again with every step eager (same
model and cache); ``--profile-batches`` adds ``profile_decode.py``'s breakdown of the decode
steps (GPU busy time, launches, host time by part of the step) in each mode.

``--async on,off`` runs the decode and job rows with asynchronous scheduling on and then off
(same engine; default ``on``, the engine's default); ``--timeline-batches 64`` adds, per async
setting, ``step_timeline.py``'s steady-decode rows: host ms per step, device busy and idle ms
per step, the busy fraction of the wall time and the idle gaps, with no sync per step.

``--job N`` adds an offline job: N requests with prompt lengths drawn from 64..1,024 and output
lengths from 16..``--job-max-tokens`` (seeded), all submitted at once, so the batch shrinks as
requests finish and the positions' entry counts vary from step to step. It runs eagerly (if
``--modes`` has ``eager``) and, with graphs, padded and once more with ``padding=False`` graphs
(one graph per exact sequence and entry count; ``--job-graphs padded`` keeps the first only);
each graph mode's graphs are built once per bench run (shared by the async settings). Only steady state is timed: per mode and async setting
the job runs once untimed (Triton's compilations, graph captures), then ``--job-repeats`` timed
runs, of which the row shows the median. Rows: wall seconds, generated
tokens per second, graphs held, graphs captured during the timed run (0 unless the warm-up
missed a shape) and steps replayed in it; the JSON adds the warm-up run's seconds.

    python -m benchmarks.engine.bench_engine --out bench-out/engine.json
    python -m benchmarks.engine.bench_engine --layers 28 --prefill-prompts 1,8 \
        --decode-batches 1,8,32,64 --reference-ops-batches 1,32 --out bench-out/engine-28.json
    python -m benchmarks.engine.bench_engine --modes eager --batch-invariant \
        --out bench-out/engine-invariant.json
    python -m benchmarks.engine.bench_engine --layers 4 --decode-batches 64 --job 64 \
        --async on,off --timeline-batches 64 --out bench-out/engine-async.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, write_json
from benchmarks.engine import step_timeline
from benchmarks.engine.prefill_breakdown import parse_shapes
from benchmarks.sweep.models import resolve_model
from benchmarks.timing import INCLUDED, CallTiming, time_call
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.sampling import SamplingParams


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int = 1) -> CallTiming:
    """Time generating ``max_tokens`` for every prompt with :func:`benchmarks.timing.time_call`
    as the sweep times its prefill points (one untimed call first, so Triton's compilations for
    this batch shape are not timed; then ``repeats`` timed calls); fails unless every request
    produced all its tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []

    def call() -> None:
        outputs[:] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    timing = time_call(call, warmup=1, repeats=repeats)
    short = [o for o in outputs if len(o.outputs[0].token_ids) != max_tokens]
    if short:
        first = short[0].outputs[0]
        raise RuntimeError(
            f"{len(short)} of {len(prompts)} requests did not produce {max_tokens} tokens "
            f"(first: {len(first.token_ids)} tokens, finish_reason {first.finish_reason!r}, "
            f"error {first.error!r})"
        )
    return timing


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int = 1) -> float:
    """Median seconds of :func:`_timed`."""
    return _timed(llm, prompts, max_tokens, repeats).median_s


def step_floor_bytes(model, batch: int) -> int:
    """Least bytes a decode step of ``batch`` tokens reads: non-expert weights (not the
    embedding, which is gathered) plus the expected routed experts touched in every layer."""
    config = model.config
    experts, others, per_expert = 0, 0, {}
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            layer = name.split(".experts.")[0]
            index = int(name.split(".experts.")[1].split(".")[0])
            per_expert[(layer, index)] = per_expert.get((layer, index), 0) + size
            experts += size
        elif "embed" not in name:
            others += size
    n, k = config.n_routed_experts, config.num_experts_per_tok
    touched = n * (1 - (1 - k / n) ** batch)
    layers = len({layer for layer, _ in per_expert})
    mean_expert = experts / max(len(per_expert), 1)
    return int(others + layers * touched * mean_expert)


def _decode_row(llm, model, gen, vocab, batch, tokens, copy_tbs, ops, repeats=1) -> dict:
    """One decode row: the median of ``repeats`` timed calls generating ``tokens`` tokens less
    the median of ``repeats`` calls generating one, over ``tokens - 1`` steps; each call's
    seconds are kept (``full_s`` / ``base_s``), so a one-off stall in a call shows."""
    prompts = torch.randint(3, vocab, (batch, 128), generator=gen).tolist()
    base = _timed(llm, prompts, 1, repeats)
    full = _timed(llm, prompts, tokens, repeats)
    steps = tokens - 1
    step_s = (full.median_s - base.median_s) / steps
    floor_ms = step_floor_bytes(model, batch) / (copy_tbs * 1e12) * 1e3
    return {"phase": "decode", "ops": ops, "batch": batch, "tokens": batch * steps,
            "seconds": full.median_s - base.median_s, "tok/s": batch / step_s,
            "tok/s/user": 1 / step_s, "step_ms": step_s * 1e3, "floor_ms": floor_ms,
            "of_floor": floor_ms / (step_s * 1e3), "full_s": list(full.samples_s),
            "base_s": list(base.samples_s)}  # fmt: skip


def _profiles(llm: LLM, vocab: int, batches: list[int], modes: list[str]) -> list[dict]:
    """``profile_decode``'s breakdown of decode steps of each batch, in each mode."""
    from benchmarks.engine.profile_decode import print_result, profile_batch

    options = argparse.Namespace(prompt_len=128, tokens=6, top=30)
    results = []
    for mode in modes:
        with _mode(llm, mode):
            for batch in batches:
                result = profile_batch(llm, vocab, batch, options)
                result["mode"] = mode
                print_result(mode, result, 10)
                results.append(result)
    return results


@contextlib.contextmanager
def _mode(llm: LLM, mode: str):
    """``graphs``: the engine's decode graphs (as loaded); ``eager``: none, every step eager."""
    runner = llm._core.executor
    graphs = runner.graphs
    if mode == "graphs" and graphs is None:
        raise RuntimeError("mode graphs: the engine loaded without decode graphs")
    runner.graphs = graphs if mode == "graphs" else None
    try:
        yield
    finally:
        runner.graphs = graphs


def _graph_counts(graphs: DecodeGraphs | None) -> tuple[int, int]:
    """(shapes captured or failed so far, steps replayed so far) of ``graphs``."""
    return (len(graphs.graphs) + len(graphs.failed), graphs.num_replays) if graphs else (0, 0)


def _job_rows(
    llm: LLM,
    vocab: int,
    count: int,
    max_tokens: int,
    modes: list[str],
    built: dict[bool, DecodeGraphs],
    repeats: int = 1,
    paddings: tuple[str, ...] = ("padded", "exact"),
) -> list[dict]:
    """The ``--job`` rows (see the module docstring): per mode one untimed run, then the timed
    one; ``built`` maps padding to the graph mode's graphs, kept across calls (async settings)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(64, 1025, (count,), generator=gen).tolist()
    outputs = torch.randint(16, max_tokens + 1, (count,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    runner = llm._core.executor
    loaded = runner.graphs
    cuda = runner.device.type == "cuda"  # (the CPU test runs the job without a sync)
    runs = [("eager", None)] * ("eager" in modes) + [(f"graphs{tag}", padding) for tag, padding in
                                ((", padded", True), (", exact counts", False))
                                if "graphs" in modes and loaded is not None
                                and ("padded" if padding else "exact") in paddings]  # fmt: skip

    def job() -> tuple[float, int]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in done)

    rows = []
    for mode, padding in runs:
        if padding is not None and padding not in built:
            built[padding] = DecodeGraphs(runner.model, runner.cache, padding=padding,
                                          capture=loaded.capture,
                                          max_batch_size=loaded.max_batch_size,
                                          max_context=loaded.max_context)  # fmt: skip
        graphs = runner.graphs = built[padding] if padding is not None else None
        warmup_s, _ = job()  # Triton's compilations and the captures of the job's shapes
        before = _graph_counts(graphs)
        runs_s = []
        for _ in range(repeats):
            seconds, tokens = job()
            if tokens != sum(outputs):
                raise RuntimeError(f"job ({mode}): {tokens} of {sum(outputs)} tokens generated")
            runs_s.append(seconds)
        seconds = statistics.median(runs_s)
        after = _graph_counts(graphs)
        rows.append({"phase": "job", "ops": f"kernels, {mode}", "batch": count,
                     "tokens": tokens, "seconds": seconds, "tok/s": tokens / seconds,
                     "graphs": len(graphs.graphs) if graphs else 0,
                     "captures": after[0] - before[0], "replays": after[1] - before[1],
                     "warmup_s": warmup_s, "runs_s": runs_s})  # fmt: skip
    runner.graphs = loaded
    return rows


def _prefill_shapes(args) -> list[tuple[int, int]]:
    """``--prefill-shapes`` if given, else ``--prefill-prompts`` prompts of ``--prompt-len``."""
    if args.prefill_shapes:
        return parse_shapes(args.prefill_shapes, "--prefill-shapes")
    return [(n, args.prompt_len) for n in _batches(args.prefill_prompts)]


def _prefill_rows(llm: LLM, gen, vocab: int, args, ops: str) -> list[dict]:
    rows = []
    for n, length in _prefill_shapes(args):
        prompts = torch.randint(3, vocab, (n, length), generator=gen).tolist()
        seconds = _run(llm, prompts, 1, args.repeats)
        rows.append({"phase": "prefill", "ops": ops, "batch": n, "prompt_len": length,
                     "tokens": n * length, "seconds": seconds,
                     "tok/s": n * length / seconds})  # fmt: skip
    return rows


def _batches(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="v4-flash-dummy",
                        choices=("v4-flash-dummy", "v41-flash-dummy"))  # fmt: skip
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per prefill row")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step (default: the engine's)")  # fmt: skip
    parser.add_argument("--prefill-prompts", default="1,4,8")
    parser.add_argument("--prefill-shapes", default="",
                        help="PROMPTSxTOKENS list (8x1024,1x8192,1x32768): replaces the two above")  # fmt: skip
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=17)
    parser.add_argument("--decode-repeats", type=int, default=3,
                        help="timed calls per decode row (each of the two calls it differences)")  # fmt: skip
    parser.add_argument("--reference-ops-batches", default="",
                        help="decode batches to repeat with DEEPINFER_REFERENCE_OPS=1")  # fmt: skip
    parser.add_argument("--reference-ops-tokens", type=int, default=5)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--profile-batches", default="",
                        help="profile decode steps of these batches (profile_decode.py)")  # fmt: skip
    parser.add_argument("--modes", default="graphs,eager",
                        help="decode rows with the decode CUDA graphs and/or eagerly")  # fmt: skip
    parser.add_argument("--batch-invariant", action="store_true",
                        help="repeat prefill and eager decode rows with DEEPINFER_BATCH_INVARIANT=1")  # fmt: skip
    parser.add_argument("--job", type=int, default=0, help="requests of the offline job (0: none)")
    parser.add_argument("--job-max-tokens", type=int, default=256)
    parser.add_argument("--job-repeats", type=int, default=1,
                        help="timed runs of the job per row (the row shows the median)")  # fmt: skip
    parser.add_argument("--job-graphs", default="padded,exact",
                        help="the job's graph rows: padded and/or exact (counts)")  # fmt: skip
    parser.add_argument("--async", dest="async_modes", default="on",
                        help="asynchronous scheduling for decode and job rows: on, off, on,off")  # fmt: skip
    parser.add_argument("--timeline-batches", default="",
                        help="steady-decode timeline rows (step_timeline.py) of these batches")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        source = resolve_model(args.model, args.layers)
        _prefill_shapes(args)
    except ValueError as e:
        parser.error(str(e))
    start = time.perf_counter()
    llm = LLM(
        source.path, load_format="dummy", max_num_seqs=64,
        max_model_len=max(4096, *(length + 1 for _, length in _prefill_shapes(args))),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    model = llm._core.executor.model
    copy_tbs = copy_bandwidth_tbs()
    gen = torch.Generator().manual_seed(0)
    vocab = source.config.get("text_config", source.config)["vocab_size"]
    rows = []
    _run(llm, [[1] * 64], 2)  # warm-up (Triton compiles)
    rows += _prefill_rows(llm, gen, vocab, args, "kernels")
    modes = [m for m in args.modes.split(",") if m]
    asyncs = [a for a in args.async_modes.split(",") if a]
    timelines = []
    job_graphs: dict[bool, DecodeGraphs] = {}  # padding -> graphs, built once
    for a in asyncs:
        step_timeline.set_async(llm, a == "on")
        for mode in modes:
            with _mode(llm, mode):
                for b in _batches(args.decode_batches):
                    rows.append(_decode_row(llm, model, gen, vocab, b, args.decode_tokens,
                                            copy_tbs, f"kernels, {mode}, async {a}",
                                            args.decode_repeats))  # fmt: skip
        if args.job:
            paddings = tuple(args.job_graphs.split(","))
            job = _job_rows(llm, vocab, args.job, args.job_max_tokens, modes, job_graphs,
                            args.job_repeats, paddings)  # fmt: skip
            rows += [dict(r, ops=f"{r['ops']}, async {a}") for r in job]
        for b in _batches(args.timeline_batches):
            prompts = torch.randint(3, vocab, (b, 128), generator=gen).tolist()
            timelines.append(step_timeline.measure(llm, prompts, args.decode_tokens))
    step_timeline.set_async(llm, True)
    profiles = _profiles(llm, vocab, _batches(args.profile_batches), modes)
    os.environ["DEEPINFER_REFERENCE_OPS"] = "1"
    with _mode(llm, "eager"):
        for b in _batches(args.reference_ops_batches):
            tokens = args.reference_ops_tokens
            rows.append(_decode_row(llm, model, gen, vocab, b, tokens, copy_tbs, "reference"))
    os.environ.pop("DEEPINFER_REFERENCE_OPS")
    if args.batch_invariant:
        os.environ["DEEPINFER_BATCH_INVARIANT"] = "1"
        rows += _prefill_rows(llm, gen, vocab, args, "kernels, batch-invariant")
        with _mode(llm, "eager"):
            for b in _batches(args.decode_batches):
                rows.append(_decode_row(llm, model, gen, vocab, b, args.decode_tokens, copy_tbs,
                                        "kernels, batch-invariant, eager",
                                        args.decode_repeats))  # fmt: skip
        os.environ.pop("DEEPINFER_BATCH_INVARIANT")
    budget = llm.scheduler_config.max_num_batched_tokens
    print(f"{source.label}, load {load_s:.1f} s, {budget} batched tokens per step, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")  # fmt: skip
    print(f"copy rate {copy_tbs:.2f} TB/s; floor_ms = least bytes per step / copy rate")
    columns = ["phase", "ops", "batch", "tokens", "seconds", "tok/s", "tok/s/user", "step_ms"]
    print_table([r for r in rows if r["phase"] != "job"], columns + ["floor_ms", "of_floor"])
    print_table(
        [r for r in rows if r["phase"] == "job"],
        ["phase", "ops", "batch", "tokens", "seconds", "tok/s", "graphs", "captures", "replays"],
    )
    if timelines:
        print_table(timelines, step_timeline.COLUMNS)
    payload = {"env": environment(), "model": source.label, "layers": args.layers,
               "max_num_batched_tokens": budget, "timed": INCLUDED, "load_s": load_s,
               "copy_tbs": copy_tbs, "rows": rows, "profiles": profiles,
               "timelines": timelines}  # fmt: skip
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
