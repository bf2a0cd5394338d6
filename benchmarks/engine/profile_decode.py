"""Where an engine decode step spends its time, split by part of the step.

Greedy decode of ``--batch`` prompts of ``--prompt-len`` tokens for ``--tokens`` tokens through
``LLM.generate``; after a warm-up generation of the same shape, the decode-only steps (every
step after the prefill step) are profiled twice: torch.profiler (CPU + CUDA: GPU busy time per
step = the sum of device kernel time, the number of kernel launches, CPU time in torch ops, the
``aten::to`` count) and cProfile (cumulative time of the parts of a step: scheduler, runner
input and metadata build, the model forward per layer, logits, sampling, update and output
processing, Triton's launcher; plus the functions with the most own time). Prints a table and
writes JSON. ``--modes graphs,eager`` profiles with the engine's decode CUDA graphs, then with
every step eager (same model and cache).

    python -m benchmarks.engine.profile_decode --dummy-layers 8 --batch 1,64 --out prof.json
    python -m benchmarks.engine.profile_decode --accelerator cpu --batch 2 --tokens 6
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_json
from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]

RATIOS = [0, 0] + [4, 128] * 21  # V4-Flash layer kinds

# part of a step -> (file name, function name) whose cumulative time it is
PARTS = {
    "step (EngineCore.step)": ("engine_core.py", "step"),
    "scheduler.schedule": ("scheduler.py", "schedule"),
    "runner.execute": ("model_runner.py", "execute"),
    "runner inputs (_apply + _batch)": ("model_runner.py", "_batch"),
    "runner _apply (diffs)": ("model_runner.py", "_apply"),
    "metadata (build_metadata)": ("metadata.py", "build_metadata"),
    "step_context": ("model.py", "step_context"),
    "decode graphs (fill + replay)": ("cuda_graphs.py", "run"),
    "layers (Block.forward)": ("block.py", "forward"),
    "layers (Block.forward_v41)": ("block.py", "forward_v41"),
    "logits": ("model.py", "logits"),
    "sample_and_verify": ("verify.py", "sample_and_verify"),
    "scheduler.update": ("scheduler.py", "update"),
    "output processing": ("output_processor.py", "process"),
    "triton launcher (jit.py run)": ("jit.py", "run"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "tiny_model" / "checkpoint"))
    p.add_argument("--dummy-layers", type=int, default=0,
                   help="profile a dummy-weight V4-Flash-shaped model of this many layers")  # fmt: skip
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--tokens", type=int, default=6, help="tokens per request (1 prefill step)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--modes", default="graphs,eager",
                   help="profile with the decode CUDA graphs and/or with every step eager")  # fmt: skip
    p.add_argument("--top", type=int, default=30, help="functions printed by own time")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _load(args) -> tuple[LLM, int]:
    kwargs = dict(accelerator=args.accelerator, speculative_tokens=0, max_num_seqs=64)
    if args.dummy_layers:
        from benchmarks.model.dummy_forward import v4_flash_config

        config = v4_flash_config(RATIOS[: args.dummy_layers])
        directory = Path(tempfile.mkdtemp())
        (directory / "config.json").write_text(json.dumps(config))
        llm = LLM(str(directory), load_format="dummy", max_model_len=4096,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.85, **kwargs)  # fmt: skip
        return llm, config["vocab_size"]
    llm = LLM(args.model, **kwargs)
    return llm, llm._core.executor.model.config.vocab_size


class _DecodeProfiler:
    """Wraps ``EngineCore.step``: steps after the first of a generation run under the
    profilers (the first is the prefill of every prompt)."""

    def __init__(self, core) -> None:
        self.core, self.inner = core, core.step
        self.steps, self.decode_steps, self.wall = 0, 0, []
        self.cprofile = cProfile.Profile()
        self.torch_prof = None

    def __call__(self):
        self.steps += 1
        if self.steps == 1:
            return self.inner()
        if self.decode_steps == 0:
            self.torch_prof.start()
        self.decode_steps += 1
        sync()
        start = time.perf_counter()
        self.cprofile.enable()
        updates = self.inner()
        self.cprofile.disable()
        sync()
        self.wall.append(time.perf_counter() - start)
        return updates


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _torch_totals(prof, steps: int) -> dict:
    """Per-step totals from torch.profiler's averages."""
    averages = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in averages)
    kernels = sum(e.count for e in averages if getattr(e, "self_device_time_total", 0) > 0
                  and e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    aten = [e for e in averages if e.key.startswith("aten::")]
    aten_to = sum(e.count for e in averages if e.key == "aten::to")
    top = sorted(averages, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    return {
        "gpu_busy_ms": device_us / 1e3 / steps,
        "kernel_launches": kernels / steps,
        "aten_self_cpu_ms": sum(e.self_cpu_time_total for e in aten) / 1e3 / steps,
        "aten_calls": sum(e.count for e in aten) / steps,
        "aten_to_calls": aten_to / steps,
        "top_device": [
            {
                "op": e.key[:60],
                "calls": e.count / steps,
                "device_ms": getattr(e, "self_device_time_total", 0) / 1e3 / steps,
            }
            for e in top[:40]
        ],  # fmt: skip
    }


def _cprofile_parts(profile: cProfile.Profile, steps: int, layers: int, top: int) -> dict:
    stats = pstats.Stats(profile).stats
    parts = {}
    for label, (file, name) in PARTS.items():
        cum = sum(v[3] for (f, _, n), v in stats.items() if n == name and f.endswith(file))
        calls = sum(v[0] for (f, _, n), v in stats.items() if n == name and f.endswith(file))
        if calls:
            parts[label] = {"ms_per_step": cum / steps * 1e3, "calls_per_step": calls / steps}
    for key in ("layers (Block.forward)", "layers (Block.forward_v41)"):
        if key in parts:
            parts[key]["ms_per_layer"] = parts[key]["ms_per_step"] / layers
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    own = [
        {"function": f"{Path(f).name}:{line}({name})", "calls_per_step": v[1] / steps,
         "own_ms_per_step": v[2] / steps * 1e3}
        for (f, line, name), v in rows
    ]  # fmt: skip
    return {"parts": parts, "top_own": own}


def profile_batch(llm: LLM, vocab: int, batch: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for _ in range(2):  # warm-up: compiles, graph captures
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    core = llm._core
    wrapper = _DecodeProfiler(core)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    wrapper.torch_prof = profile(activities=activities)
    core.step = wrapper
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del core.step
    wrapper.torch_prof.stop()
    steps = wrapper.decode_steps
    # unprofiled decode steps (the profilers' own overhead is large for host-bound steps)
    timed = _time_decode_steps(llm, prompts, params)
    layers = llm._core.executor.model.config.num_layers
    result = {"batch": batch, "decode_steps": steps, "layers": layers,
              "step_ms_profiled": sum(wrapper.wall) / steps * 1e3,
              "step_ms": timed * 1e3}  # fmt: skip
    result.update(_torch_totals(wrapper.torch_prof, steps))
    result.update(_cprofile_parts(wrapper.cprofile, steps, layers, args.top))
    result["gpu_busy_fraction"] = result["gpu_busy_ms"] / result["step_ms"]
    return result


def _time_decode_steps(llm: LLM, prompts, params) -> float:
    """Median seconds of a decode step (steps after the first), no profiler attached."""
    core = llm._core
    inner, times = core.step, []

    def timed_step():
        sync()
        start = time.perf_counter()
        updates = inner()
        sync()
        times.append(time.perf_counter() - start)
        return updates

    core.step = timed_step
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del core.step
    decode = sorted(times[1:])
    return decode[len(decode) // 2]


def print_result(label: str, r: dict, top: int) -> None:
    print(f"\n== {label}: batch {r['batch']}, {r['layers']} layers, {r['decode_steps']} decode "
          f"steps: step {r['step_ms']:.2f} ms (profiled {r['step_ms_profiled']:.2f}), GPU busy "
          f"{r['gpu_busy_ms']:.2f} ms ({100 * r['gpu_busy_fraction']:.0f}%), "
          f"{r['kernel_launches']:.0f} kernels, {r['aten_calls']:.0f} aten calls "
          f"({r['aten_to_calls']:.0f} aten::to, {r['aten_self_cpu_ms']:.1f} ms self CPU)")  # fmt: skip
    for label_, p in r["parts"].items():
        extra = f"  ({p['ms_per_layer']:.3f} ms/layer)" if "ms_per_layer" in p else ""
        print(f"  {label_:36s} {p['ms_per_step']:8.2f} ms/step {p['calls_per_step']:8.1f} "
              f"calls{extra}")  # fmt: skip
    print("  device top:")
    for d in r["top_device"][:8]:
        print(f"    {d['device_ms']:7.3f} ms {d['calls']:6.1f}x  {d['op']}")
    print(f"  own time top {top}:")
    for row in r["top_own"][:top]:
        print(f"    {row['own_ms_per_step']:7.2f} ms {row['calls_per_step']:8.1f}x  "
              f"{row['function']}")  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"graphs", "eager"}:
        raise SystemExit(f"--modes {args.modes!r}: expected graphs and/or eager")
    llm, vocab = _load(args)
    runner = llm._core.executor
    graphs, results = runner.graphs, []
    for mode in modes:
        if mode == "graphs" and graphs is None:
            print("graphs: this engine has no decode graphs (CPU, speculation or dense experts)")
            continue
        runner.graphs = graphs if mode == "graphs" else None
        for batch in [int(b) for b in args.batch.split(",") if b.strip()]:
            r = profile_batch(llm, vocab, batch, args)
            r["mode"] = mode
            print_result(mode, r, args.top)
            results.append(r)
    runner.graphs = graphs
    payload = {"env": environment(), "args": vars(args), "results": results}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
