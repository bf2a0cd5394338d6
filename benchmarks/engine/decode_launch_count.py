"""The kernel launches one steady decode step would make on an NVIDIA GPU, per layer, on a CPU.

A decode step at batch 1 is launch-bound: inside the decode graph each launch costs a gap of
about 2 us on top of its work, so the count matters more than the kernels' speed. This counts
them without a GPU. A tiny quantised V4 / V4.1 checkpoint (the engine tests' configs, FP8
linears and FP4 experts) is prefilled on the reference ops; then each decode step runs the
fixed-shape forward a decode graph captures (``DecodeGraphs(capture=False)``, padding rows
included) with the routed experts on the grouped op (the path a GPU takes, not the reference
loop) and the NVIDIA backend's ops on CPU tensors, its Triton kernels under the interpreter.
The first decode step is not counted. Counted per step, under ``torch.profiler``:

- ``triton``: every Triton kernel launch, by kernel name;
- ``torch``: the torch ops outside the kernels ops that launch a kernel (leaf aten ops but
  views, allocations and no-op casts), by op;
- ``in ops``: the torch ops inside the kernels ops' implementations that launch a kernel
  (``mm`` is a cuBLAS GEMM, ``fill_`` a zeroing, ``copy_`` a cast or gather).

Each is split into the decoder blocks (per layer) and the rest (embedding, head). An aten op
counts as one launch; a GPU may split one (cuBLAS split-K adds a reduce kernel) or fuse none.
Launch counts, not times; the tiny configs differ from V4-Flash in their layer mix, head and
expert counts, not in the kernels a layer calls. The FP8 products take the plan a GPU takes
(the stream kernel at decode sizes, which quantises its own activation rows), without cuBLAS.
On CPU tensors the MoE op picks other kernels than a GPU at decode sizes
(``moe_gate_up_kernel`` for ``moe_stream_gate_up_kernel``): one launch each all the same.

    python -m benchmarks.engine.decode_launch_count --model tiny-v4,tiny-v41 --batch 1,64
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: before imports

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import environment, print_table, write_json  # noqa: E402
from benchmarks.engine.prefill_op_count import VIEWS, _frame  # noqa: E402

OP, LAYER, TRITON = "op:", "layer", "triton:"
# aten ops that launch nothing themselves: views, allocations, metadata, casts and copies (the
# ``copy_`` they call launches; a ``to`` or ``contiguous`` that calls none returned its input)
NO_LAUNCH = VIEWS | frozenset(
    f"aten::{name}"
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                 "to", "contiguous", "resize_", "set_", "item", "_local_scalar_dense",
                 "is_nonzero", "result_type", "_reshape_alias", "_unsafe_view", "view_as",
                 "expand_as", "reshape_as", "type_as", "lift_fresh_copy", "numpy_T", "promote_types",
                 "is_same_size", "_has_compatible_shallow_copy_type", "record_stream")
)  # fmt: skip
GEMMS = frozenset(f"aten::{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul"))


def _tiny_checkpoint(name: str) -> Path:
    from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config

    config = tiny_v4_config() if name == "tiny-v4" else tiny_v41_config(vision=False)
    directory = Path(tempfile.mkdtemp(prefix=f"deepinfer-launches-{name}-"))
    make_random_checkpoint(directory, config, quantized=True, seed=0)
    return directory


@contextlib.contextmanager
def nvidia_on_cpu():
    """The NVIDIA backend's ops take CPU tensors (their Triton kernels run under the
    interpreter) while inside; the reference ops again afterwards."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.testing import patch_triton_interpreter
    from deepinfer.kernels_nvidia import backend
    from deepinfer.kernels_nvidia.gemm import ops as gemm

    patch_triton_interpreter()
    on_cpu = dataclasses.replace(backend, device_type="cpu", is_available=lambda: True)
    saved = registry.active(), gemm.default_plan
    registry._active = registry.Selection("nvidia", on_cpu, "decode_launch_count: on CPU")
    registry._resolve_cached.cache_clear()

    def gpu_plan(m, n, k, a_group, sub_k, block_size, out_dtype, device):
        batch_invariant = gemm.envs.batch_invariant()
        return gemm.choose_plan(m, n, k, sub_k, out_dtype, batch_invariant=batch_invariant,
                                on_cpu=False)  # fmt: skip

    gemm.default_plan = gpu_plan
    try:
        yield
    finally:
        registry._active, gemm.default_plan = saved
        registry._resolve_cached.cache_clear()


def _launch_label(kernel, kwargs) -> str:
    """``triton:<kernel>``, or ``triton-empty:<kernel>`` for a grid of no programs (Triton's
    launcher skips it on a GPU)."""
    grid = kwargs.get("grid")
    empty = isinstance(grid, tuple) and any(int(g) == 0 for g in grid)
    return ("triton-empty:" if empty else TRITON) + kernel.fn.__name__


def _empty_input(event) -> bool:
    """Whether an aten op reads an empty tensor (``cat``: only empty ones), so that its result
    is empty and a GPU launches nothing for it (profiled with ``record_shapes``)."""
    shapes = [s for s in event.input_shapes or () if isinstance(s, list) and s]
    tensors = [t for s in shapes for t in (s if isinstance(s[0], list) else [s]) if t]
    if event.name == "aten::cat":
        return bool(tensors) and all(0 in t for t in tensors)
    return any(0 in t for t in tensors)  # (index: an empty index list, an empty result)


@contextlib.contextmanager
def named_ranges():
    """Profiler ranges around every outermost kernels op call (``op:<name>``), every Triton
    launch (``triton:<kernel>``) and every decoder block (``layer``)."""
    from triton.runtime.interpreter import InterpretedFunction

    from deepinfer.engine.model.block import Block
    from deepinfer.kernels import registry

    depth = [0]

    def op_range(name, impl):
        def call(*args, **kwargs):
            if depth[0]:
                return impl(*args, **kwargs)
            depth[0] += 1
            try:
                with torch.profiler.record_function(OP + name):
                    return impl(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    def ranged(label, fn):
        def call(self, *args, **kwargs):
            with torch.profiler.record_function(label(self, kwargs)):
                return fn(self, *args, **kwargs)

        return call

    patched = [(registry, "resolve"), (InterpretedFunction, "run"), (Block, "forward"),
               (Block, "forward_v41")]  # fmt: skip
    saved = [getattr(owner, attr) for owner, attr in patched]
    resolve = registry.resolve
    registry.resolve = lambda name, args=(): op_range(name, resolve(name, args))
    InterpretedFunction.run = ranged(_launch_label, InterpretedFunction.run)
    Block.forward = ranged(lambda *_: LAYER, Block.forward)
    Block.forward_v41 = ranged(lambda *_: LAYER, Block.forward_v41)
    try:
        yield
    finally:
        for (owner, attr), value in zip(patched, saved, strict=True):
            setattr(owner, attr, value)


def _line(event) -> str:
    """The innermost line of our code above a profiler event (``with_stack``: the Python frames
    are its parents), the registry's dispatch and this tool's wrappers skipped."""
    parent = event.cpu_parent
    while parent is not None:
        frame = _frame(parent.name)
        if frame and not frame.startswith("deepinfer/kernels/registry.py"):
            return frame
        parent = parent.cpu_parent
    return "(no deepinfer frame)"


def _launches_below(event) -> bool:
    """Whether an aten op calls a launching aten op (``to`` calls ``copy_``; ``index`` calls
    only views and is itself the launch)."""
    return any(
        (c.name.startswith("aten::") and c.name not in NO_LAUNCH) or _launches_below(c)
        for c in event.cpu_children
    )


def classify(events, lines: bool = False) -> Counter:
    """``(kind, name, in_layer)`` -> launches, over a profile's events: kind ``triton`` (a
    launch), ``torch`` (a launching leaf aten op outside the kernels ops) or ``in ops``; with
    ``lines`` the name carries the line of our code that issued a torch op."""
    found: Counter = Counter()
    for event in events:
        name = event.name
        is_triton = name.startswith(TRITON)
        if not is_triton and (not name.startswith("aten::") or name in NO_LAUNCH):
            continue
        if not is_triton and (_launches_below(event) or _empty_input(event)):
            continue  # a composite (the ops it calls are counted), or nothing to compute
        in_op = in_layer = False
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("triton:", "triton-empty:")):
                break  # the interpreter's own torch calls
            in_op = in_op or parent.name.startswith(OP)
            in_layer = in_layer or parent.name == LAYER
            parent = parent.cpu_parent
        else:
            kind = "triton" if is_triton else ("in ops" if in_op else "torch")
            label = name[len(TRITON) :] if is_triton else name
            if lines and not is_triton:
                label = f"{label} {_line(event)}"
            found[(kind, label, in_layer)] += 1
    return found


def count_model(name: str, batch: int, args: argparse.Namespace) -> dict:
    from deepinfer.engine.frontend.llm import LLM
    from deepinfer.engine.model.moe import MoE
    from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
    from deepinfer.sampling import SamplingParams

    directory = _tiny_checkpoint(name)
    max_len = args.prompt_len + args.steps + 4
    llm = LLM(str(directory), dtype="bfloat16", block_size=16 if name == "tiny-v41" else 128,
              max_model_len=max_len, max_num_seqs=batch, speculative_tokens=0,
              max_num_batched_tokens=max(batch * args.prompt_len, 256))  # fmt: skip
    runner = llm._core.executor
    model = runner.model
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.grouped_experts = True  # the GPU's grouped op, not the reference loop
    counts: list[Counter] = []

    class CountedGraphs(DecodeGraphs):
        def run(self, plan, rows, feed=None):
            from torch.profiler import ProfilerActivity, profile

            backend = contextlib.nullcontext() if args.lines else nvidia_on_cpu()
            with backend, named_ranges():
                if not self.graphs:  # the first decode step: uncounted
                    return super().run(plan, rows, feed)
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                             with_stack=args.lines) as prof:  # fmt: skip
                    logits = super().run(plan, rows, feed)
            counts.append(classify(prof.events(), args.lines))
            return logits

    runner.graphs = CountedGraphs(model, runner.cache, max_batch_size=batch,
                                  max_context=max_len, min_context=16, capture=False)  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if not counts:
        raise RuntimeError(f"{name} batch {batch}: no decode step went through the graphs")
    layers = model.config.num_layers
    total = sum(counts, Counter())
    steps = len(counts)
    rows = [{"kind": kind, "name": label, "in_layer": in_layer, "per_step": n / steps}
            for (kind, label, in_layer), n in sorted(total.items())]  # fmt: skip
    result = {"model": name, "batch": batch, "layers": layers, "steps": steps, "rows": rows}
    for kind in ("triton", "torch", "in ops"):
        inside = sum(r["per_step"] for r in rows if r["kind"] == kind and r["in_layer"])
        outside = sum(r["per_step"] for r in rows if r["kind"] == kind and not r["in_layer"])
        result[kind] = {"per_layer": inside / layers, "outside_layers": outside}
    result["per_layer"] = sum(result[k]["per_layer"] for k in ("triton", "torch", "in ops"))
    result["outside_layers"] = sum(
        result[k]["outside_layers"] for k in ("triton", "torch", "in ops")
    )
    return result


def report(result: dict, top: int, lines: bool = False) -> None:
    print(f"-- {result['model']} batch {result['batch']}: {result['layers']} layers, "
          f"{result['steps']} decode steps counted")  # fmt: skip
    for kind in ("triton", "torch", "in ops"):
        r = result[kind]
        print(f"{kind:>7}: {r['per_layer']:6.2f} per layer, {r['outside_layers']:6.1f} "
              "outside the layers")  # fmt: skip
    print(f"  total: {result['per_layer']:6.2f} per layer, {result['outside_layers']:6.1f} "
          "outside the layers")  # fmt: skip
    if top:
        layers = result["layers"]
        rows = [{"kind": r["kind"], "name": r["name"], "per_layer": r["per_step"] / layers}
                for r in result["rows"] if r["in_layer"] and (not lines or r["kind"] == "torch")]  # fmt: skip
        rows.sort(key=lambda r: (-r["per_layer"], r["kind"], r["name"]))
        for r in rows:
            r["per_layer"] = f"{r['per_layer']:.2f}"
        print_table(rows[:top], ["kind", "name", "per_layer"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-v4,tiny-v41", help="comma-separated: tiny-v4, tiny-v41")
    p.add_argument("--batch", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=4, help="decode steps counted (after one)")
    p.add_argument("--prompt-len", type=int, default=21, help="prompt tokens per sequence")
    p.add_argument("--top", type=int, default=60, help="per-layer rows printed (0: none)")
    p.add_argument(
        "--lines",
        action="store_true",
        help="torch ops by the line that issued them (the ops then run the reference: the "
        "interpreter under the stack tracer is too slow)",
    )
    p.add_argument("--out", help="JSON file for the counts")
    args = p.parse_args(argv)
    names = args.model.split(",")
    unknown = sorted(set(names) - {"tiny-v4", "tiny-v41"})
    if unknown:
        p.error(f"--model: {unknown} not among tiny-v4, tiny-v41")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        p.error(f"--batch: got {args.batch!r}, expected comma-separated integers")
    results = []
    for name in names:
        for batch in batches:
            results.append(count_model(name, batch, args))
            report(results[-1], args.top, args.lines)
    write_json(args.out, {"env": environment(), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
