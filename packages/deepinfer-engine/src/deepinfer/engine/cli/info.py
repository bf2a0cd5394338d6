"""What ``deepinfer info`` reports: versions, the accelerator chosen and why, devices, and which
backend implements each op natively; with ``--model DIR`` also the model's KV cache: its
formats, bytes per token and per sequence, and the capacity the engine would size."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

DISTRIBUTIONS = (
    "deepinfer-kernels",
    "deepinfer-parallel",
    "deepinfer-sampling",
    "deepinfer-spec",
    "deepinfer-engine",
    "deepinfer-kernels-nvidia",
    "deepinfer-kernels-ascend",
)
THIRD_PARTY = ("torch", "triton", "safetensors", "huggingface_hub", "tokenizers", "xgrammar")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    import torch

    found = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found.append(
                f"cuda:{i} {p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})"
            )
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        found += [f"npu:{i}" for i in range(npu.device_count())]
    found.append(f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    return found


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def report(accelerator: str | None = None) -> str:
    """The full report as text. Raises AcceleratorUnavailableError for a missing accelerator."""
    from deepinfer import kernels

    selection = kernels.select_accelerator(accelerator)
    lines = ["DeepInfer", "", "packages:"]
    lines += [f"  {d:26s} {_version(d)}" for d in DISTRIBUTIONS]
    lines += [f"  {d:26s} {_version(d)}" for d in THIRD_PARTY]
    lines += [f"  {'python':26s} {platform.python_version()}"]
    lines += [
        "",
        f"accelerator: {selection.accelerator} (backend {selection.backend.name}; "
        f"{selection.reason})",
        "",
        "devices:",
    ]
    lines += [f"  {d}" for d in _devices()]
    backends = kernels.discover_backends()
    lines += ["", "backends installed:"]
    for accel, b in backends.items():
        state = "available" if b.is_available() else f"unavailable: {b.unavailable_reason()}"
        lines.append(f"  {accel:7s} {b.name} ({state})")
    accels = list(backends)
    rows = [
        [name, *(row.get(a, "-") for a in accels)] for name, row in kernels.implementation_table()
    ]
    lines += ["", "ops (implementation per backend):"]
    lines += ["  " + r for r in _table(["op", *accels], rows)]
    return "\n".join(lines)


def model_report(model: str) -> str:
    """The KV cache of the checkpoint ``model`` (its config only; no weights are read): formats,
    bytes, and the capacity the start-up sizing would give without its profile run."""
    import torch

    from deepinfer.engine.checkpoint import resolve_model_path
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model.config_parsing import load_config
    from deepinfer.engine.runner.cache_report import cache_lines, estimate_capacity
    from deepinfer.engine.runner.loading import CPU_CACHE_BUDGET

    path = resolve_model_path(model, weights=False)
    config = load_config(path)
    defaults = EngineConfig.__dataclass_fields__
    block_size = defaults["block_size"].default
    lines = [f"model: {path} ({config.architecture}, {config.num_layers} layers)", "KV cache:"]
    lines += [f"  {line}" for line in cache_lines(config, block_size=block_size)]
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    if torch.cuda.is_available():
        memory, used = torch.cuda.get_device_properties(0).total_memory, weights
        utilization = defaults["gpu_memory_utilization"].default
        where = f"cuda:0 at gpu_memory_utilization {utilization}, weights {weights / 2**30:.1f} GiB"
    else:
        memory, used, utilization = CPU_CACHE_BUDGET, 0, 1.0
        where = f"cpu, the engine's cache budget {CPU_CACHE_BUDGET / 2**30:.0f} GiB"
    try:
        capacity = estimate_capacity(
            config, memory_bytes=memory, used_bytes=used, utilization=utilization,
            max_num_seqs=defaults["max_num_seqs"].default, block_size=block_size,
        )  # fmt: skip
        found = capacity.describe()
    except ValueError as e:
        found = str(e)
    lines.append(f"  capacity ({where}; activations not counted): {found}")
    return "\n".join(lines)
