"""What ``deepinfer info`` reports: versions, the accelerator chosen and why, devices, and which
backend implements each op natively."""

from __future__ import annotations

import importlib.metadata
import platform

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
