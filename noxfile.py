"""Test sessions: one per package and accelerator, plus integration, lint and import contracts.

    uvx nox                      # the default set for this machine's accelerator
    uvx nox -s "tests(package='sampling', accelerator='cpu')"
    uvx nox -l                   # every session

Each ``tests`` session installs only that package and what it needs, from ``uv.lock``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PACKAGES = {
    "kernels": ("deepinfer-kernels", "packages/deepinfer-kernels"),
    "parallel": ("deepinfer-parallel", "packages/deepinfer-parallel"),
    "sampling": ("deepinfer-sampling", "packages/deepinfer-sampling"),
    "spec": ("deepinfer-spec", "packages/deepinfer-spec"),
    "engine": ("deepinfer-engine", "packages/deepinfer-engine"),
    "kernels-nvidia": ("deepinfer-kernels-nvidia", "kernels-nvidia"),
    "kernels-ascend": ("deepinfer-kernels-ascend", "kernels-ascend"),
}
ACCELERATORS = ("cpu", "nvidia", "ascend")
# pytest marker expression per accelerator: device-only tests run only where the device is.
MARKERS = {"cpu": "not gpu and not npu", "nvidia": "not npu", "ascend": "not gpu"}
# A backend package tested under the other vendor's accelerator means nothing.
MEANINGLESS = {("kernels-nvidia", "ascend"), ("kernels-ascend", "nvidia")}


def machine_accelerator() -> str:
    """nvidia if an NVIDIA driver is visible, ascend if an Ascend one is, else cpu."""
    if os.environ.get("DEEPINFER_ACCELERATOR"):
        return os.environ["DEEPINFER_ACCELERATOR"]
    if shutil.which("nvidia-smi") or Path("/dev/nvidiactl").exists():
        return "nvidia"
    if shutil.which("npu-smi") or Path("/dev/davinci_manager").exists():
        return "ascend"
    return "cpu"


def _sync(session: nox.Session, *args: str) -> None:
    session.run_install(
        "uv", "sync", "--locked", *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )  # fmt: skip


# Two pytest workers, a test file each at a time (module fixtures stay shared; a file may split
# itself with xdist_group marks, and files with slow tests start first: conftest.py), where
# the tests are many single-process ones and run on the CPU (the CI machine has two cores; GPU
# tests size their caches from the free device memory, so they keep one process).
PARALLEL = ("-n", "2", "--dist", "loadgroup")


def _parallel(accelerator: str) -> tuple[str, ...]:
    return PARALLEL if accelerator == "cpu" else ()


def _pytest(session: nox.Session, accelerator: str, *paths: str) -> None:
    env = {"DEEPINFER_ACCELERATOR": accelerator}
    if accelerator == "cpu":
        # one intra-op thread per test process: two of them share the two cores, and on these
        # tiny shapes torch's thread pool spends far longer spinning than computing
        env["OMP_NUM_THREADS"] = "1"
    session.run(
        "python", "-m", "pytest", *paths, "-m", MARKERS[accelerator], *session.posargs, env=env,
    )  # fmt: skip


@nox.session
@nox.parametrize("accelerator", ACCELERATORS)
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str, accelerator: str) -> None:
    """One package's tests on one accelerator (cpu: reference backend, Triton interpreter)."""
    if (package, accelerator) in MEANINGLESS:
        session.skip(f"{package} has nothing to test on {accelerator}")
    if accelerator != "cpu" and machine_accelerator() != accelerator:
        session.skip(f"no {accelerator} device on this machine")
    dist, path = PACKAGES[package]
    _sync(session, "--package", dist, "--no-default-groups", "--group", "test")
    if package in ("engine", "kernels-nvidia"):
        # the engine's multi-process (gloo) tests are one work unit: its tests/conftest.py
        _pytest(session, accelerator, f"{path}/tests", *_parallel(accelerator))
    else:
        _pytest(session, accelerator, f"{path}/tests")


@nox.session
def integration(session: nox.Session) -> None:
    """End-to-end tests through the public API only, every package installed."""
    accelerator = machine_accelerator()
    _sync(session, "--all-packages", "--group", "bench")
    _pytest(session, accelerator, "integration", *_parallel(accelerator))


@nox.session
def scripts(session: nox.Session) -> None:
    """The benchmarks' and the examples' own tests (the sweep's smoke run, the tiny model's
    training recipe), every package installed with matplotlib: they test repository scripts
    and engine internals, so they live beside the scripts, not in ``integration/``."""
    accelerator = machine_accelerator()
    _sync(session, "--all-packages", "--group", "bench")
    _pytest(
        session, accelerator, "benchmarks/tests", "examples/tiny_model/tests",
        "examples/distributed/tests", *_parallel(accelerator),
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree, and the source-layout rules
    (no ``_extra`` file names, no file over 400 lines, no lab notes in comments)."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_source.py", str(ROOT))


@nox.session(venv_backend="none")
def imports(session: nox.Session) -> None:
    """The import directions of DESIGN.md, as contracts that fail when broken."""
    session.run("python3", "tools/check_imports.py", str(ROOT))


def _default_sessions() -> list[str]:
    accelerator = machine_accelerator()
    chosen = ["lint", "imports"]
    for package in PACKAGES:
        for acc in ("cpu",) if accelerator == "cpu" else ("cpu", accelerator):
            if (package, acc) not in MEANINGLESS:
                chosen.append(f"tests(package='{package}', accelerator='{acc}')")
    return [*chosen, "integration", "scripts"]


nox.options.sessions = _default_sessions()
