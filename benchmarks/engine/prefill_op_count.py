"""The torch ops one prefill step issues outside the ``deepinfer.kernels`` ops, by function.

Each op the model or the runner calls directly (``aten::where``, ``aten::to``, ``aten::cat``
...) costs a host launch; in a host-bound step (a short prefill, decode without graphs) they
add up. For each model the engine prefills ``--shapes`` once untimed, then once under
``torch.profiler`` (``with_stack``) with every kernels op call in a named range
(``op_work.OpRecorder``). Counted: the outermost torch ops outside every kernels op range (an
op's own internals belong to the op), grouped by the innermost ``deepinfer`` function that
issued them (profiler Python frames name a function by its first line); those under a
decoder block (``model/block.py`` on the stack) are also counted per layer. No speculation
(draft stages off), as in ``prefill_breakdown``. Also printed: the bytes ``apply_rope``
moves as ``op_work`` counts them. Op counts, not times. On a CPU the routed experts run the
reference loop (``MoE._looped``), which a GPU replaces by one grouped op, and host-to-device
copies are skipped.

    python -m benchmarks.engine.prefill_op_count --model tiny-v4,tiny-v41 --shapes 2x64
    python -m benchmarks.engine.prefill_op_count --model v4-flash-dummy --layers 16 \\
        --shapes 8x1024 --accelerator auto --top 0         # on a GPU: rope bytes at that shape
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.engine.op_work import OP_PREFIX, OpRecorder
from benchmarks.engine.prefill_breakdown import parse_shapes
from benchmarks.sweep.models import ModelSource, resolve_model
from benchmarks.sweep.roofline import H200

LAYER_FILE = "deepinfer/engine/model/block.py:"
_FRAME = re.compile(r"^(?P<path>.*?)\((?P<line>\d+)\): (?P<func>.*)$")


def _tiny(name: str) -> ModelSource:
    """``tiny-v4`` / ``tiny-v41``: the engine tests' tiny configs, dummy weights (and the test
    tokenizer, which V4.1's Engram tables are bound through)."""
    from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
    from deepinfer.engine.testing.random_checkpoint import write_testing_tokenizer

    config = tiny_v4_config() if name == "tiny-v4" else tiny_v41_config(vision=False)
    directory = Path(tempfile.mkdtemp(prefix="deepinfer-opcount-"))
    (directory / "config.json").write_text(json.dumps(config))
    write_testing_tokenizer(directory, config.get("text_config", config)["vocab_size"])
    label = f"{name} (engine test config, dummy weights)"
    return ModelSource(name, str(directory), "dummy", config, label, name == "tiny-v4")


VIEWS = frozenset(
    f"aten::{name}"
    for name in ("alias", "as_strided", "detach", "detach_", "expand", "flatten", "lift_fresh",
                 "narrow", "permute", "reshape", "resolve_conj", "resolve_neg", "select",
                 "slice", "split", "squeeze", "t", "transpose", "unbind", "unflatten",
                 "unsqueeze", "view")
)  # fmt: skip


def _frame(name: str) -> str | None:
    """``package/path.py:line (function)`` of a profiler Python event in our code, else None."""
    m = _FRAME.match(name)
    if m is None or "deepinfer/" not in m["path"]:
        return None
    path = m["path"][m["path"].rindex("deepinfer/") :]
    return f"{path}:{m['line']} ({m['func']})"


def outside_ops(events) -> list[tuple[str, str, bool]]:
    """(torch op, the innermost line of our code that called it, whether a decoder block is on
    its stack) of every outermost torch op outside the kernels ops' ranges. With
    ``with_stack`` the Python frames are the events' parents."""
    found = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith(
            "aten::"
        ):
            continue
        line, in_layer, nested = None, False, False
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", OP_PREFIX)):
                nested = True
                break
            frame = _frame(parent.name)
            line = line or frame
            in_layer = in_layer or (frame is not None and frame.startswith(LAYER_FILE))
            parent = parent.cpu_parent
        if not nested:
            found.append((event.name, line or "(no deepinfer frame)", in_layer))
    return found


def count_model(source: ModelSource, args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.engine.frontend.llm import LLM
    from deepinfer.sampling import SamplingParams

    (prompts, length), = parse_shapes(args.shapes)  # fmt: skip
    llm = LLM(source.path, accelerator=args.accelerator, load_format=source.load_format,
              max_num_seqs=prompts, max_model_len=length + 2,
              max_num_batched_tokens=prompts * length, enforce_eager=True, speculative_tokens=0,
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    text = source.config.get("text_config", source.config)
    gen = torch.Generator().manual_seed(prompts * 100_003 + length)
    ids = torch.randint(3, text["vocab_size"], (prompts, length), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step() -> None:
        llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)

    step()  # compilation, first-use caches
    recorder = OpRecorder(H200)
    with recorder.active(), profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        step()
    ops = outside_ops(prof.events())
    layers = text["num_hidden_layers"]
    rope = recorder.work.get("apply_rope")
    result = {"model": source.label, "prompts": prompts, "prompt_len": length, "layers": layers,
              "apply_rope_calls": rope.calls if rope else 0,
              "apply_rope_mb": rope.bytes / 1e6 if rope else 0.0}  # fmt: skip
    for kind, chosen in (("all", ops), ("non_view", [o for o in ops if o[0] not in VIEWS])):
        in_layers = sum(1 for *_, in_layer in chosen if in_layer)
        result[kind] = {"ops": len(chosen), "in_layers": in_layers,
                        "per_layer": in_layers / layers, "outside_layers": len(chosen) - in_layers,
                        "by_name": dict(Counter(name for name, *_ in chosen).most_common())}  # fmt: skip
    by_line = Counter((name, line) for name, line, _ in ops if name not in VIEWS)
    result["by_line"] = [{"calls": c, "op": n, "line": line}
                         for (n, line), c in by_line.most_common()]  # fmt: skip
    return result


def report(result: dict, top: int) -> None:
    print(f"-- {result['model']}: {result['prompts']} x {result['prompt_len']} tokens, "
          f"{result['layers']} layers")  # fmt: skip
    for kind, label in (("all", "torch ops"), ("non_view", "of them not views")):
        r = result[kind]
        print(f"{label} outside kernels ops: {r['ops']} ({r['per_layer']:.1f} per layer, "
              f"{r['outside_layers']} outside the layers)")  # fmt: skip
    print(f"apply_rope: {result['apply_rope_calls']} calls, {result['apply_rope_mb']:.3f} MB "
          "counted (op_work)")  # fmt: skip
    if top:
        print_table(result["by_line"][:top], ["calls", "op", "line"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-v4,tiny-v41",
                   help="comma-separated: tiny-v4, tiny-v41 (the engine tests' configs), "
                        "tiny, v4-flash-dummy, v41-flash-dummy or a checkpoint")  # fmt: skip
    p.add_argument("--layers", type=int, default=4, help="layers of a dummy-shape model")
    p.add_argument("--shapes", default="2x64", help="one PROMPTSxTOKENS step")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--top", type=int, default=40, help="source lines printed (0: none)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", help="JSON file for the counts")
    args = p.parse_args(argv)
    try:
        if len(parse_shapes(args.shapes)) != 1:
            raise ValueError(f"--shapes: got {args.shapes!r}, expected one PROMPTSxTOKENS")
        names = args.model.split(",")
        sources = [_tiny(n) if n.startswith("tiny-") else resolve_model(n, args.layers)
                   for n in names]  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    results = []
    for source in sources:
        results.append(count_model(source, args))
        report(results[-1], args.top)
    write_json(args.out, {"env": environment(), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
