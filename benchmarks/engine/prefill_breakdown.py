"""Where one prefill step's time goes: every op's time, share and ceiling.

For each model and each shape (``--shapes 8x1024,1x8192``: prompts x tokens, one engine step:
the token budget is set to the largest shape) the engine prefills once untimed (compilation),
then once under ``torch.profiler`` with every ``deepinfer.kernels`` op call in a named range
(``op_work.OpRecorder``). Time is grouped by owner: an op's group holds every kernel launched
inside its outermost call; kernels launched outside any op (layout copies, ``torch.cat``,
unfused elementwise work of the model and the runner) are grouped by the torch op that
launched them (``torch aten::copy_``). On CUDA an op's kernels are those between the marker
kernels its call queued (``op_markers``: Triton's launches leave no record the profiler links),
a group's time is its kernels' device time and ``device idle`` is the step's wall time minus the
union of kernel intervals (the device waiting for the host); on a CPU it is the ops' own CPU
time and ``host, outside torch ops`` the rest.

Each op's ceiling is its counted work (``op_work.py``: FLOPs at the FP8 or bf16 rate, or bytes)
over the H200 rates measured on the lent machine (``roofline.H200``), or over this device's
own with ``--measured-rates``; ``of_ceiling`` = ceiling / time; on CUDA the JSON names each
group's longest kernels (``kernels_ms``). The step's wall time is also
timed without the profiler (``benchmarks.timing.time_call``, median of ``--repeats``).

    python -m benchmarks.engine.prefill_breakdown --model v4-flash-dummy,v41-flash-dummy \\
        --layers 4 --shapes 8x1024,1x8192 --out bench-out/breakdown
    python -m benchmarks.engine.prefill_breakdown --model tiny --accelerator cpu \\
        --shapes 2x32 --out bench-out/breakdown                               # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.engine.op_markers import UNOWNED, is_marker, marker_groups
from benchmarks.engine.op_work import OP_PREFIX, OpRecorder, OpWork
from benchmarks.engine.step_timeline import device_gaps
from benchmarks.sweep.models import ModelSource, resolve_model
from benchmarks.sweep.roofline import H200, Device
from benchmarks.timing import time_call

COLUMNS = ["op", "calls", "ms", "share", "host_ms", "gflop", "mb", "ceiling_ms", "of_ceiling"]


def parse_shapes(text: str, flag: str = "--shapes") -> list[tuple[int, int]]:
    """``"8x1024,1x8192"`` -> ``[(8, 1024), (1, 8192)]`` (prompts, tokens per prompt)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{flag}: got {item!r}, expected PROMPTSxTOKENS like 8x1024")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _owner(event) -> str:
    """The group an event's time belongs to: its outermost op range, else the outermost torch
    op around it (what the model or runner called directly)."""
    op, top = None, event
    while event is not None:
        if event.name.startswith(OP_PREFIX):
            op = event.name[len(OP_PREFIX) :]
        top, event = event, event.cpu_parent
    return op if op is not None else f"torch {top.name}"


def device_kernels(events, markers: bool = False) -> list:
    """The device-side kernel (and copy) events: no op range's annotation, and no op marker
    unless ``markers``."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and not e.name.startswith(OP_PREFIX)
            and not getattr(e, "is_user_annotation", False)
            and (markers or not is_marker(e.name))]  # fmt: skip


def marked_ops(events, calls: list[str]):
    """:func:`~benchmarks.engine.op_markers.marker_groups` of the profile: the recorder's op
    ``calls`` paired with their markers on the device timeline."""
    return marker_groups(device_kernels(events, markers=True), calls)


def group_times(events, on_cuda: bool, marked=None) -> dict[str, tuple[float, int]]:
    """Seconds and event count per owner: kernel time on CUDA, self CPU time on a CPU. With
    ``marked`` (:func:`marked_ops`) an op's group is every kernel between its markers, and
    kernels outside every op that no launch record owns (Triton's) form their own group."""
    groups: dict[str, tuple[float, int]] = {}
    cpu = torch.autograd.DeviceType.CPU
    for event in events:
        if event.device_type != cpu:
            continue
        if on_cuda:
            # an op range's own device-side span is an annotation, not a kernel
            us = sum(k.duration for k in event.kernels if not k.name.startswith(OP_PREFIX))
        else:
            us = event.self_cpu_time_total
        owner = _owner(event)
        if us > 0 and (marked is None or owner.startswith("torch ")):
            seconds, n = groups.get(owner, (0.0, 0))
            groups[owner] = (seconds + us * 1e-6, n + 1)
    if marked is not None:
        ops, _, outside = marked
        unowned = outside - sum(seconds for seconds, _ in groups.values())
        groups |= ops
        if unowned > 1e-9:
            groups[UNOWNED] = (unowned, 0)
    return groups


def top_kernels(events, count: int = 3, marked=None) -> dict[str, list[tuple[str, float]]]:
    """Per owner, its ``count`` longest kernels by name with their total ms (CUDA); with
    ``marked``, ops' kernels by their markers (as :func:`group_times`)."""
    by_owner: dict[str, dict[str, float]] = {}
    for event in events:
        owner = _owner(event)
        if marked is not None and not owner.startswith("torch "):
            continue
        for kernel in getattr(event, "kernels", []):
            if kernel.name.startswith(OP_PREFIX):
                continue
            names = by_owner.setdefault(owner, {})
            names[kernel.name] = names.get(kernel.name, 0.0) + kernel.duration * 1e-3
    if marked is not None:
        by_owner |= marked[1]
    return {owner: sorted(names.items(), key=lambda kv: -kv[1])[:count]
            for owner, names in by_owner.items()}  # fmt: skip


def op_host_times(events) -> dict[str, float]:
    """Host seconds inside each op's calls (launches and the op's Python; the recorder puts
    ranges on outermost calls only): on CUDA, an op whose host time exceeds its kernel time is
    host-bound."""
    times: dict[str, float] = {}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith(OP_PREFIX):
            name = event.name[len(OP_PREFIX) :]
            times[name] = times.get(name, 0.0) + event.cpu_time_total * 1e-6
    return times


def breakdown_rows(
    groups: dict[str, tuple[float, int]], work: dict[str, OpWork], wall_s: float, rest: tuple,
    host: dict[str, float],
) -> list[dict]:  # fmt: skip
    """One row per group, largest first, then the ``rest`` row (label, seconds) and the total:
    time, share of the step's wall time, host time, counted work and ceiling."""
    rows = []
    for name, (seconds, events) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        w = work.get(name)
        row = {"op": name, "calls": w.calls if w else events, "ms": seconds * 1e3,
               "share": seconds / wall_s}  # fmt: skip
        if name in host:
            row["host_ms"] = host[name] * 1e3
        if w is not None:
            row |= {"gflop": w.flops / 1e9, "mb": w.bytes / 1e6, "ceiling_ms": w.floor_s * 1e3,
                    "of_ceiling": w.floor_s / seconds, "rate": "+".join(sorted(w.rates))}  # fmt: skip
        rows.append(row)
    label, seconds = rest
    rows.append({"op": label, "ms": seconds * 1e3, "share": seconds / wall_s})
    floor = sum(w.floor_s for w in work.values())
    rows.append({"op": "step (wall, profiled)", "ms": wall_s * 1e3, "share": 1.0,
                 "ceiling_ms": floor * 1e3, "of_ceiling": floor / wall_s})  # fmt: skip
    return rows


def printable(rows: list[dict], top: int) -> list[dict]:
    """The ``top`` largest groups, the others summed in one row, then the closing rows."""
    groups, closing = rows[:-2], rows[-2:]
    if len(groups) <= top:
        return rows
    rest = groups[top:]
    other = {"op": f"other ({len(rest)} groups)", "ms": sum(r["ms"] for r in rest),
             "share": sum(r["share"] for r in rest)}  # fmt: skip
    return groups[:top] + [other] + closing


def profile_shape(llm, vocab: int, prompts: int, length: int, device: Device, repeats: int):
    """One shape's breakdown (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.sampling import SamplingParams

    gen = torch.Generator().manual_seed(prompts * 100_003 + length)
    ids = torch.randint(3, vocab, (prompts, length), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step() -> None:
        llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)

    clean = time_call(step, warmup=1, repeats=repeats)
    on_cuda = torch.cuda.is_available() and llm.config.accelerator != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    recorder = OpRecorder(device, markers="cuda" if on_cuda else None)
    with recorder.active(), profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.events()
    marked = None
    if on_cuda:
        try:
            marked = marked_ops(events, recorder.calls)
        except ValueError as e:  # markers interleaved across streams: launch records only
            print(f"op markers not used ({e}); Triton kernels stay unattributed")
    groups = group_times(events, on_cuda, marked)
    if on_cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in device_kernels(events)]
        busy_s = device_gaps(spans)["busy_us"] * 1e-6
        rest = ("device idle (host)", max(0.0, wall - busy_s))
    else:
        rest = ("host, outside torch ops", max(0.0, wall - sum(s for s, _ in groups.values())))
    rows = breakdown_rows(groups, recorder.work, wall, rest, op_host_times(events))
    kernels = top_kernels(events, marked=marked) if on_cuda else {}
    for row in rows:
        if row["op"] in kernels:
            row["kernels_ms"] = kernels[row["op"]]
    return {"prompts": prompts, "prompt_len": length, "tokens": prompts * length,
            "wall_ms": clean.median_s * 1e3, "wall_ms_profiled": wall * 1e3,
            "tok/s": prompts * length / clean.median_s,
            "rows": rows}  # fmt: skip


def run_model(source: ModelSource, args: argparse.Namespace, device: Device) -> dict:
    from deepinfer.engine.frontend.llm import LLM

    shapes = parse_shapes(args.shapes)
    llm = LLM(
        source.path, accelerator=args.accelerator, load_format=source.load_format,
        max_num_seqs=max(n for n, _ in shapes), max_model_len=max(n for _, n in shapes) + 2,
        max_num_batched_tokens=max(n * length for n, length in shapes), enforce_eager=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    vocab = source.config.get("text_config", source.config)["vocab_size"]
    results = []
    for prompts, length in shapes:
        result = profile_shape(llm, vocab, prompts, length, device, args.repeats)
        print(f"-- {source.label}: {prompts} x {length} tokens, {result['wall_ms']:.1f} ms "
              f"({result['tok/s']:.0f} tok/s; profiled {result['wall_ms_profiled']:.1f} ms)")  # fmt: skip
        print_table(printable(result["rows"], args.top), COLUMNS)
        results.append(result)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"model": source.label, "shapes": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="v4-flash-dummy,v41-flash-dummy",
                   help="comma-separated: v4-flash-dummy, v41-flash-dummy, tiny or a checkpoint")  # fmt: skip
    p.add_argument("--layers", type=int, default=4, help="layers of a dummy-shape model")
    p.add_argument("--shapes", default="8x1024,1x8192", help="PROMPTSxTOKENS, comma-separated")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="unprofiled timed steps per shape")
    p.add_argument("--top", type=int, default=25, help="groups printed (the JSON has all)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--measured-rates", action="store_true",
                   help="ceilings from this device's measured rates instead of the H200's")  # fmt: skip
    p.add_argument("--out", required=True, help="directory for the JSON")
    args = p.parse_args(argv)
    try:
        parse_shapes(args.shapes)
        sources = [resolve_model(name, args.layers) for name in args.model.split(",")]
    except ValueError as e:
        p.error(str(e))
    device = H200
    if args.measured_rates:
        from benchmarks.sweep.ceilings import measure_device

        device, _ = measure_device("cuda" if torch.cuda.is_available() else "cpu")
    models = [run_model(source, args, device) for source in sources]
    kind = "cuda" if torch.cuda.is_available() and args.accelerator != "cpu" else "cpu"
    name = f"{time.strftime('%Y-%m-%d')}-{kind}-prefill-breakdown-{args.layers}layers.json"
    out = Path(args.out) / name
    rates = {"bandwidth_Bps": device.bandwidth, "fp8_flops": device.flops,
             "bf16_flops": device.attention_flops}  # fmt: skip
    write_json(out, {"env": environment(), "layers": args.layers, "rates": rates,
                     "measured_rates": args.measured_rates, "models": models})  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
