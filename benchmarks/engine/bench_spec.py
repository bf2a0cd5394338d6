"""DSpark speculative decoding: decode tokens/s per user with speculation off, fixed-K and
confidence-scheduled (varlen), at several batch sizes, through ``LLM.generate``.

For each mode an engine is built on ``--model`` (default: ``examples/tiny_model/checkpoint`` if
it exists, else ``examples/default_model``); for each batch size ``b`` the same ``b`` prompts
run greedy with ``max_tokens=1`` and with ``max_tokens=--decode-tokens``; decode tokens/s per
user = ``(decode_tokens - 1) / (t_full - t_first)``. Batch 1 runs each of the first ``--solo``
prompts alone in turn and averages their decode times (one prompt's accept length is not the
model's). Also reported: the mean accepted length
(tokens emitted per verify step, bonus included, averaged over requests), drafts verified and
accepted, and the step-cost curve the varlen planner measured at start-up (tokens -> ms).
Prompts: Python snippets (the tiny model's domain) or ``--prompts-file`` (one per line),
cycled to the batch size. Modes ``fixed-graphs`` and ``varlen-graphs`` turn on CUDA graphs for
verification and drafting (``DEEPINFER_SPEC_GRAPHS=1``); ``graph_replays`` counts the row's
verification and draft graph replays. Every row runs its generation once untimed first, so
the timed run is warm (its graphs captured, its kernels compiled) in every mode (not with
``--smoke``). ``--async on,off`` repeats every row with asynchronous scheduling on
and off (same engine); ``--timeline`` adds, per row, ``step_timeline.py``'s steady-decode
numbers (host ms per step, device busy and idle ms per step, busy fraction, idle gaps).

    python -m benchmarks.engine.bench_spec --out bench-out/spec.json          # GPU
    python -m benchmarks.engine.bench_spec --smoke --out bench-out/spec.json # CPU, seconds
    python -m benchmarks.engine.bench_spec --async on,off --timeline --out bench-out/spec.json
    python -m benchmarks.engine.bench_spec --modes off,fixed,fixed-graphs,varlen,varlen-graphs \
        --batches 1,8,64 --timeline --out bench-out/spec-graphs.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.engine import step_timeline
from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]

PROMPTS = [
    "def main():\n    ",
    "import os\nimport sys\n\n\ndef ",
    "class Parser:\n    def __init__(self, text):\n        ",
    "for i in range(10):\n    ",
    "    def test_",
    "if __name__ == '__main__':\n    ",
    "try:\n    import json\nexcept ImportError:\n    ",
    "    return ",
]
# mode -> (drafts: 0 or --k, confidence-scheduled, CUDA graphs for speculative steps)
MODES = {
    "off": (0, False, False),
    "fixed": (None, False, False),
    "varlen": (None, True, False),
    "fixed-graphs": (None, False, True),
    "varlen-graphs": (None, True, True),
}


def default_model() -> str:
    tiny = REPO / "examples" / "tiny_model" / "checkpoint"
    return str(tiny if (tiny / "config.json").exists() else REPO / "examples" / "default_model")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    _sync()
    return time.perf_counter() - start, outputs


def _engine(args, mode: str) -> LLM:
    k, varlen, graphs = MODES[mode]
    os.environ["DEEPINFER_SPEC_GRAPHS"] = "1" if graphs else "0"  # read when the engine loads
    max_model_len = args.max_prompt_len + args.decode_tokens + 16
    max_batch = max(args.batches)
    blocks = max_batch * -(-max_model_len // args.block_size) + 8
    return LLM(
        args.model, accelerator=args.accelerator, dtype=args.dtype, load_format=args.load_format,
        max_model_len=max_model_len, max_num_seqs=max_batch, block_size=args.block_size,
        num_cache_blocks=blocks, speculative_tokens=args.k if k is None else k,
        spec_varlen=varlen,
    )  # fmt: skip


def _prompts(llm: LLM, args, batch: int) -> list[list[int]]:
    texts = PROMPTS
    if args.prompts_file:
        texts = [t for t in Path(args.prompts_file).read_text().splitlines() if t.strip()]
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        gen = torch.Generator().manual_seed(batch)
        return torch.randint(20, 200, (batch, 16), generator=gen).tolist()
    ids = [tokenizer.encode(t)[: args.max_prompt_len] for t in texts]
    return [ids[i % len(ids)] for i in range(batch)]


def _mode_rows(args, mode: str) -> tuple[list[dict], dict | None]:
    llm = _engine(args, mode)
    runner = llm._core.executor
    spec = getattr(runner, "spec", None)
    curve = None
    if spec is not None and spec.cost_curve is not None:
        curve = {"num_tokens": list(spec.cost_curve.num_tokens), "ms": list(spec.cost_curve.cost)}
    _timed(llm, _prompts(llm, args, 1), 4)  # warm-up (Triton compiles, caches)
    rows = []
    for setting in args.async_modes:
        step_timeline.set_async(llm, setting == "on")
        for batch in args.batches:
            rows.append(_row(llm, args, mode, spec, batch, setting))
            print(rows[-1], flush=True)  # a row survives a time box that cuts the run
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, curve


def _row(llm: LLM, args, mode: str, spec, batch: int, setting: str) -> dict:
    prompts = _prompts(llm, args, batch)
    # batch 1: each of the first --solo prompts alone in turn (one prompt's accept length is
    # not the model's), the decode time summed
    groups = [[p] for p in _prompts(llm, args, args.solo)] if batch == 1 else [prompts]
    if not args.smoke:  # untimed: the row's graphs captured, its kernels built
        _timed(llm, groups[0], args.decode_tokens)
    replays_before = _graph_replays(llm)
    decode_s, outputs = 0.0, []
    for group in groups:
        first, _ = _timed(llm, group, 1)
        full, out = _timed(llm, group, args.decode_tokens)
        decode_s += max(full - first, 1e-9)
        outputs += out
    decode_s /= len(groups)  # per group of `batch` requests
    lengths = [o.metrics.mean_accepted_length for o in outputs]
    lengths = [x for x in lengths if x is not None]
    row = {
        "mode": mode, "async": setting, "batch": batch, "k": spec.num_draft_tokens if spec else 0,
        "tok/s/user": (args.decode_tokens - 1) / decode_s,
        "tok/s": batch * (args.decode_tokens - 1) / decode_s,
        "accept_len": statistics.mean(lengths) if lengths else 1.0,
        "drafts": sum(o.metrics.num_draft_tokens for o in outputs),
        "accepted": sum(o.metrics.num_accepted_tokens for o in outputs),
        "graph_replays": _graph_replays(llm) - replays_before,
    }  # fmt: skip
    if args.timeline:
        timeline = step_timeline.measure(llm, prompts, args.decode_tokens)
        row.update({k: timeline[k] for k in TIMELINE})
    return row


def _graph_replays(llm: LLM) -> int:
    """Step and draft graph replays so far (0 without graphs)."""
    runner = llm._core.executor
    graphs = getattr(runner, "graphs", None)
    drafts = getattr(getattr(runner, "drafter", None), "graphs", None)
    return sum(g.num_replays for g in (graphs, drafts) if g is not None)


TIMELINE = ["host_ms", "gpu_busy_ms", "idle_ms", "busy_frac", "max_gap_ms"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--modes", default="off,fixed,varlen")
    parser.add_argument("--k", type=int, default=5, help="drafts per step (capped at the "
                        "checkpoint's dspark_block_size)")  # fmt: skip
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--prompts-file", default=None)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--solo", type=int, default=len(PROMPTS),
                        help="batch-1 rows: prompts timed alone in turn (their mean)")  # fmt: skip
    parser.add_argument("--async", dest="async_modes", default="on",
                        help="asynchronous scheduling: on, off or on,off (each row per setting)")  # fmt: skip
    parser.add_argument("--timeline", action="store_true",
                        help="add host / device busy / idle ms per step (step_timeline.py)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks it runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.accelerator, args.batches, args.decode_tokens = "cpu", "1,2", 6
        args.max_prompt_len, args.k, args.block_size = 8, min(args.k, 3), 16
        args.solo = min(args.solo, 2)
    args.model = args.model or default_model()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.async_modes = [a for a in args.async_modes.split(",") if a]
    if any(a not in ("on", "off") for a in args.async_modes):
        parser.error(f"--async {','.join(args.async_modes)}: expected on, off or on,off")
    if args.solo < 1:
        parser.error(f"--solo {args.solo}: expected >= 1 prompts for the batch-1 rows")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    if args.dtype is None:
        args.dtype = "float32" if args.accelerator == "cpu" else "bfloat16"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows, curves = [], {}
    for mode in args.modes:
        mode_rows, curve = _mode_rows(args, mode)
        rows += mode_rows
        if curve is not None:
            curves[mode] = curve
    print(f"DSpark speculative decoding on {args.model} ({args.accelerator}, {args.dtype}), "
          f"{args.decode_tokens} tokens per request")  # fmt: skip
    columns = ["mode", "async", "batch", "k", "tok/s/user", "tok/s", "accept_len", "drafts",
               "accepted", "graph_replays"] + (TIMELINE if args.timeline else [])  # fmt: skip
    print_table(rows, columns)
    for mode, curve in curves.items():
        points = ", ".join(f"{n}:{ms:.2f}" for n, ms in zip(curve["num_tokens"], curve["ms"]))
        print(f"step-cost curve ({mode}, tokens:ms): {points}")
    payload = {
        "env": environment(), "model": args.model, "decode_tokens": args.decode_tokens,
        "command": " ".join(sys.argv), "rows": rows, "step_cost_curves": curves,
    }  # fmt: skip
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
