"""Prefill and decode sweeps with a transformers baseline and the roofline, one JSON per model
and Pareto PNGs (see ``benchmarks/RESULTS.md``).

    benchmarks/run_sweep.sh --model v4-flash-dummy,tiny --out bench-out/sweep   # H200
    benchmarks/run_sweep.sh --smoke --out bench-out/smoke                            # CPU, seconds

Models: ``tiny`` (embedded checkpoint), ``v4-flash-dummy`` / ``v41-flash-dummy`` (published
shapes, random weights, ``--layers N``; without it, as many layers as fit the device with the
baseline), or a local checkpoint directory. Results are labelled with the layer count.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.sweep.baseline_hf import baseline_generate, baseline_skip_reason, load_baseline
from benchmarks.sweep.ceilings import measure_device
from benchmarks.sweep.measure import SweepSettings, decode_sweep, engine_generate, prefill_sweep
from benchmarks.sweep.models import ModelSource, resolve_model
from benchmarks.sweep.plots import matplotlib_missing, write_plots
from benchmarks.sweep.roofline import Device, ModelShape, decode_point, prefill_point
from benchmarks.timing import INCLUDED


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="run_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v4-flash-dummy,tiny", help="comma-separated sources")
    p.add_argument("--layers", type=int, default=None, help="layers of a dummy-shape model")
    p.add_argument("--prefill-tokens", type=_ints, default=_ints("1024,2048,4096,8192,16384,32768,65536"))  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--concurrency", type=_ints, default=_ints("1,2,4,8,16,32,64,128,256,512"))
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=25, help="K of the max_tokens=K run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--max-point-s",
        type=float,
        default=60.0,
        help="stop a sweep after a point slower than this (keeps one run bounded)",
    )
    p.add_argument("--baseline", choices=("transformers", "none"), default="transformers")
    p.add_argument("--baseline-max-batch", type=int, default=64, help="cap baseline concurrency")
    p.add_argument("--baseline-max-tokens", type=int, default=16384, help="cap baseline prefill")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="our engine's token budget per step (default: the engine's own)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few points, seconds")
    p.add_argument("--out", required=True, help="directory for the JSON and PNGs")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.prefill_tokens, args.prompt_len = "tiny", (64, 128), 32
        args.concurrency, args.context_len, args.decode_tokens, args.repeats = (1, 4), 32, 5, 1
    if args.decode_tokens < 2:
        p.error(f"--decode-tokens: got {args.decode_tokens}, expected >= 2")
    if min(args.prefill_tokens) < args.prompt_len:
        p.error(f"--prefill-tokens: got {args.prefill_tokens}, expected each >= --prompt-len")
    return args


def auto_layers(name: str, args: argparse.Namespace, device: str) -> int | None:
    """``--layers`` if given; for a dummy shape on a GPU, the most layers whose weights fit in
    half the free memory (bf16 experts when the baseline runs: the two models are loaded one
    after the other; FP4 otherwise); 3 on a CPU."""
    if args.layers or name not in ("v4-flash-dummy", "v41-flash-dummy"):
        return args.layers
    if device != "cuda":
        return 3
    full = ModelShape.from_config(resolve_model(name, None).config)
    routed = full.num_layers * full.num_experts * full.expert_params
    per_layer = (routed + full.dense_params_per_step) / full.num_layers
    per_layer *= 2 if args.baseline == "transformers" and name == "v4-flash-dummy" else 0.6
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(full.num_layers, int(0.5 * free // per_layer)))


def settings_for(args: argparse.Namespace, source: ModelSource) -> SweepSettings:
    text = source.config.get("text_config", source.config)
    return SweepSettings(
        prefill_tokens=args.prefill_tokens, prompt_len=args.prompt_len,
        concurrency=args.concurrency, context_len=args.context_len,
        decode_tokens=args.decode_tokens, repeats=args.repeats, vocab_size=text["vocab_size"],
        max_point_s=args.max_point_s,
    )  # fmt: skip


def run_ours(source: ModelSource, settings: SweepSettings, args, device: str) -> dict:
    from deepinfer.engine.frontend.llm import LLM

    start = time.perf_counter()
    llm = LLM(
        source.path, accelerator="cpu" if device == "cpu" else "auto", load_format=source.load_format, max_num_seqs=max(settings.concurrency),
        max_model_len=max(settings.prompt_len, settings.context_len) + settings.decode_tokens + 1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    generate = engine_generate(llm)
    result = {"load_s": load_s, "timed": INCLUDED,
              "max_num_batched_tokens": llm.scheduler_config.max_num_batched_tokens,
              "prefill": prefill_sweep(generate, settings),
              "decode": decode_sweep(generate, settings)}  # fmt: skip
    del llm, generate
    _free_memory()
    return result


def run_baseline(source: ModelSource, settings: SweepSettings, args, device: str) -> dict:
    """The transformers model on the same shapes, its batch sizes capped (recorded)."""
    reason = "--baseline none" if args.baseline == "none" else baseline_skip_reason(source.is_v4)
    if reason:
        print(f"transformers baseline skipped: {reason}")
        return {"skipped": reason}
    capped = SweepSettings(
        prefill_tokens=tuple(t for t in settings.prefill_tokens if t <= args.baseline_max_tokens),
        concurrency=tuple(b for b in settings.concurrency if b <= args.baseline_max_batch),
        prompt_len=settings.prompt_len, context_len=settings.context_len,
        decode_tokens=settings.decode_tokens, repeats=settings.repeats,
        vocab_size=settings.vocab_size, max_point_s=settings.max_point_s,
    )  # fmt: skip
    model = load_baseline(source.config, device)
    generate = baseline_generate(model)
    result = {"weights": "bf16 (random init)", "prefill": prefill_sweep(generate, capped),
              "decode": decode_sweep(generate, capped)}  # fmt: skip
    del model, generate
    _free_memory()
    return result


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def roofline_curves(source: ModelSource, ceiling: Device, settings: SweepSettings) -> dict:
    shape = ModelShape.from_config(source.config)
    batches = sorted({2**i for i in range(14)} | set(settings.concurrency))
    tokens = sorted({settings.prompt_len * 2**i for i in range(9)} | set(settings.prefill_tokens))
    decode = [decode_point(shape, ceiling, b, settings.context_len) for b in batches]
    prefill = [prefill_point(shape, ceiling, t, settings.prompt_len) for t in tokens]
    for point in decode + prefill:
        point["step_ms"] = point.pop("step_s") * 1e3
    note = "" if source.is_v4 else ("decode: V4 arithmetic applied to a V4.1 layout, approximate; "
                                     "prefill: V4.1's layer schedule counted")  # fmt: skip
    device = {"bandwidth_Bps": ceiling.bandwidth, "matmul_flops": ceiling.flops,
              "attention_flops": ceiling.attention_flops}  # fmt: skip
    return {"device": device,
            "layers": shape.num_layers, "note": note, "decode": decode, "prefill": prefill}  # fmt: skip


def ratios(ours: list[dict], baseline: list[dict], key: str) -> list[dict]:
    """Our throughput over the baseline's at each point both measured."""
    theirs = {p[key]: p["tok/s/gpu"] for p in baseline}
    return [{key: p[key], "ratio": p["tok/s/gpu"] / theirs[p[key]]} for p in ours if p[key] in theirs]  # fmt: skip


def sweep_model(name: str, args: argparse.Namespace, device: str, ceiling: Device) -> dict:
    source = resolve_model(name, auto_layers(name, args, device))
    settings = settings_for(args, source)
    print(f"== {source.label}")
    ours = run_ours(source, settings, args, device)
    baseline = run_baseline(source, settings, args, device)
    result = {
        "model": {"source": name, "label": source.label, "config": source.config},
        "settings": vars(settings) | {"device": device}, "env": environment(),
        "command": "benchmarks/run_sweep.sh " + " ".join(sys.argv[1:]),
        "ours": ours, "baseline": baseline,
        "roofline": roofline_curves(source, ceiling, settings),
    }  # fmt: skip
    if "prefill" in baseline:
        result["ratio_to_baseline"] = {
            "prefill": ratios(ours["prefill"], baseline["prefill"], "tokens"),
            "decode": ratios(ours["decode"], baseline["decode"], "batch"),
        }
    return result


def with_roofline(points: list[dict], roof: list[dict], key: str) -> list[dict]:
    """``points`` with the roofline's tok/s/GPU at the same ``key`` and their share of it."""
    ceiling = {p[key]: p["tok/s/gpu"] for p in roof}
    return [p | {"roofline": ceiling[p[key]], "of_roofline": p["tok/s/gpu"] / ceiling[p[key]]}
            if p[key] in ceiling else p for p in points]  # fmt: skip


def report(result: dict, out_dir: Path, stem: str) -> None:
    """Print ours, the baseline and the roofline side by side; write the JSON and the plots."""
    roof = result["roofline"]
    for phase, key, cols in (("prefill", "tokens", ["tokens", "prompts", "step_ms", "tok/s/gpu"]),
                             ("decode", "batch", ["batch", "step_ms", "tok/s/user", "tok/s/gpu"])):  # fmt: skip
        for series in ("ours", "baseline"):
            if result[series].get(phase):
                result[series][phase] = with_roofline(result[series][phase], roof[phase], key)
                print(f"-- {phase}, {series} (roofline: {roof['layers']} layers, counted FLOPs "
                      "and bytes over the measured rates)")  # fmt: skip
                print_table(result[series][phase], cols + ["roofline", "of_roofline"])
    write_json(out_dir / f"{stem}.json", result)
    for path in write_plots(result, out_dir, stem):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if missing := matplotlib_missing():
        print(missing)
    ceiling, measured = measure_device(device)
    print(f"{device}: copy {ceiling.bandwidth / 1e12:.3f} TB/s, "
          f"GEMM {ceiling.flops / 1e12:.1f} TFLOP/s")  # fmt: skip
    for name in args.model.split(","):
        result = sweep_model(name, args, device, ceiling)
        result["roofline"]["device"]["measured"] = measured
        stem = f"{time.strftime('%Y-%m-%d')}-{device}-{Path(name).name}"
        report(result, out_dir, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
