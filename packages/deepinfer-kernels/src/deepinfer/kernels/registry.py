"""Op registry, backend discovery and dispatch.

An *op* is a public function of ``deepinfer.kernels`` declared with :func:`op`: its docstring is
the contract, its body is never run, and its ``reference`` twin is the plain-PyTorch
implementation every backend is checked against.

A *backend* is a :class:`Backend` object published under the entry-point group
``deepinfer.backends`` by a plugin distribution (``deepinfer-kernels-nvidia`` ...). The active
backend is chosen once per process from ``DEEPINFER_ACCELERATOR`` (or detection) and each op call
is routed to the backend's implementation when it has one and the inputs live on its device;
everything else runs the reference, and each such fallback is logged once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.kernels import envs
from deepinfer.kernels.invariant import ROW_WISE, call_rowwise, linear_rowwise, linears_rowwise
from deepinfer.kernels.version import API_VERSION

logger = logging.getLogger("deepinfer.kernels")

ENTRY_POINT_GROUP = "deepinfer.backends"
ACCELERATORS = ("nvidia", "ascend", "cpu")


class AcceleratorUnavailableError(RuntimeError):
    """The requested accelerator is missing or its backend cannot run here."""


@dataclass(frozen=True)
class OpDef:
    name: str
    contract: Callable[..., Any]
    reference: Callable[..., Any]


OPS: dict[str, OpDef] = {}


def op(*, reference: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a public op: the decorated function is its contract, ``reference`` its twin."""

    def wrap(contract: Callable[..., Any]) -> Callable[..., Any]:
        name = contract.__name__
        if name in OPS:
            raise RuntimeError(f"op {name!r} declared twice")
        OPS[name] = OpDef(name, contract, reference)

        @functools.wraps(contract)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return resolve(name, args)(*args, **kwargs)

        dispatch.op_name = name  # type: ignore[attr-defined]
        dispatch.reference = reference  # type: ignore[attr-defined]
        return dispatch

    return wrap


@dataclass
class Backend:
    """A kernel backend as published by a plugin.

    ``load_ops`` is called lazily (so importing a plugin's entry point never imports triton or a
    vendor package) and returns ``{op name: implementation}``. ``is_available`` says whether the
    hardware and software it needs are present, and ``unavailable_reason`` why not.
    """

    name: str
    accelerator: str
    api_version: int
    device_type: str
    is_available: Callable[[], bool]
    unavailable_reason: Callable[[], str]
    load_ops: Callable[[], dict[str, Callable[..., Any]]]
    _ops: dict[str, Callable[..., Any]] | None = field(default=None, repr=False)

    @property
    def ops(self) -> dict[str, Callable[..., Any]]:
        if self._ops is None:
            loaded = self.load_ops()
            unknown = sorted(set(loaded) - set(OPS))
            if unknown:
                raise RuntimeError(f"backend {self.name!r} implements unknown ops {unknown}")
            self._ops = loaded
        return self._ops


def _reference_ops() -> dict[str, Callable[..., Any]]:
    return {name: d.reference for name, d in OPS.items()}


REFERENCE = Backend(
    name="reference",
    accelerator="cpu",
    api_version=API_VERSION,
    device_type="cpu",
    is_available=lambda: True,
    unavailable_reason=lambda: "",
    load_ops=_reference_ops,
)


@functools.cache
def discover_backends() -> dict[str, Backend]:
    """Every backend plugin installed, keyed by accelerator (the reference one under ``cpu``)."""
    found: dict[str, Backend] = {"cpu": REFERENCE}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = ep.load()
        except Exception as e:  # a broken plugin must not take the reference path down
            logger.warning("backend entry point %s failed to load: %s", ep.value, e)
            continue
        if not isinstance(backend, Backend):
            logger.warning("entry point %s is not a deepinfer.kernels.Backend", ep.value)
            continue
        if backend.api_version != API_VERSION:
            logger.warning(
                "backend %r speaks op API %d, this deepinfer-kernels speaks %d: ignored",
                backend.name,
                backend.api_version,
                API_VERSION,
            )
            continue
        found[backend.accelerator] = backend
    return found


@dataclass(frozen=True)
class Selection:
    accelerator: str
    backend: Backend
    reason: str


def _detect() -> tuple[str, str]:
    import torch

    if torch.cuda.is_available():
        return "nvidia", f"detected CUDA device {torch.cuda.get_device_name(0)!r}"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "ascend", "detected an Ascend NPU (torch_npu)"
    return "cpu", "no CUDA device or Ascend NPU found"


def select_accelerator(requested: str | None = None) -> Selection:
    """Resolve ``requested`` (argument, else ``DEEPINFER_ACCELERATOR``, else detection).

    A named accelerator that is not usable raises :class:`AcceleratorUnavailableError` with one
    line saying why. Detection never fails: it falls back to ``cpu``.
    """
    if requested in (None, "auto"):
        requested = envs.get("DEEPINFER_ACCELERATOR")
        source = "DEEPINFER_ACCELERATOR"
    else:
        source = "argument"
    backends = discover_backends()
    if requested is None:
        accelerator, reason = _detect()
        backend = backends.get(accelerator)
        if backend is None or not backend.is_available():
            missing = f"no deepinfer-kernels-{accelerator} backend installed"
            why = missing if backend is None else backend.unavailable_reason()
            return Selection("cpu", REFERENCE, f"{reason}, but {why}: using cpu")
        return Selection(accelerator, backend, reason)
    if requested not in ACCELERATORS:
        raise AcceleratorUnavailableError(
            f"accelerator {requested!r} ({source}) is not one of {', '.join(ACCELERATORS)}"
        )
    if requested == "cpu":
        return Selection("cpu", REFERENCE, f"cpu requested by {source}")
    backend = backends.get(requested)
    if backend is None:
        raise AcceleratorUnavailableError(
            f"accelerator {requested!r} requested by {source}, but the "
            f"deepinfer-kernels-{requested} backend is not installed"
        )
    if not backend.is_available():
        raise AcceleratorUnavailableError(
            f"accelerator {requested!r} requested by {source}, but {backend.unavailable_reason()}"
        )
    return Selection(requested, backend, f"{requested} requested by {source}")


_lock = threading.Lock()
_active: Selection | None = None
_logged_fallbacks: set[str] = set()


def active() -> Selection:
    """The process-wide backend selection, resolved on first use."""
    global _active
    if _active is None:
        with _lock:
            if _active is None:
                _active = select_accelerator()
                logger.info(
                    "deepinfer.kernels: accelerator %s (%s), backend %s",
                    _active.accelerator,
                    _active.reason,
                    _active.backend.name,
                )
    return _active


def set_accelerator(accelerator: str | None) -> Selection:
    """Select the accelerator explicitly (an argument beats the environment)."""
    global _active
    selection = select_accelerator(accelerator)
    with _lock:
        _active = selection
        _resolve_cached.cache_clear()
    return selection


@functools.cache
def _resolve_cached(name: str, backend_name: str) -> Callable[..., Any] | None:
    backend = active().backend
    impl = backend.ops.get(name)
    if impl is None and backend is not REFERENCE and name not in _logged_fallbacks:
        _logged_fallbacks.add(name)
        logger.info("op %s: backend %s has no kernel, using the reference", name, backend.name)
    return impl


def _device_type(args: tuple[Any, ...]) -> str | None:
    for a in args:
        device = getattr(a, "device", None)
        if device is not None:
            return device.type
    return None


def resolve(name: str, args: tuple[Any, ...] = ()) -> Callable[..., Any]:
    """The implementation an op call with ``args`` runs: the active backend's or the reference
    (always the reference with ``DEEPINFER_REFERENCE_OPS=1``, on whatever device the tensors are).

    With ``DEEPINFER_BATCH_INVARIANT=1`` the reference runs row by row where its result could
    otherwise depend on the other rows (:mod:`deepinfer.kernels.invariant`).
    """
    selection = active()
    backend = selection.backend
    if backend is not REFERENCE and not envs.get("DEEPINFER_REFERENCE_OPS"):
        impl = _resolve_cached(name, backend.name)
        if impl is not None and _device_type(args) in (backend.device_type, None):
            return impl
    reference = OPS[name].reference
    if name == "linear" and envs.batch_invariant():
        return linear_rowwise
    if name == "linears" and envs.batch_invariant():
        return linears_rowwise
    if name in ROW_WISE and envs.batch_invariant():
        contract = OPS[name].contract
        return functools.partial(call_rowwise, name, contract, reference)
    return reference


def implementation_table() -> list[tuple[str, dict[str, str]]]:
    """For each op, which installed backend implements it natively and which falls back."""
    rows = []
    backends = discover_backends()
    for name in sorted(OPS):
        row = {}
        for accel, backend in backends.items():
            if backend is REFERENCE:
                row[accel] = "reference"
                continue
            try:
                native = name in backend.ops
            except Exception as e:  # vendor import failed: say so rather than hide the row
                row[accel] = f"error: {type(e).__name__}"
                continue
            row[accel] = "native" if native else "reference fallback"
        rows.append((name, row))
    return rows
