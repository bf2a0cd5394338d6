"""The work of one call of a ``deepinfer.kernels`` op, counted from its arguments, and the
instrumentation that names every op call in a ``torch.profiler`` trace.

Products are counted as FLOPs (2 per multiply-add) at the rate their operands run at: FP8 for
linears with FP8 or packed-FP4 weights and for the FP4 experts (activations go in as FP8), bf16
for float weights, the attention core and the indexer scores. A linear's weights must also be
read once, so its floor is the larger of the two. Every other op is counted as the bytes of the
tensors it is given and returns, read or written once (the floor of a memory-bound op); an
``out=`` buffer it returns is counted once, and ``apply_rope`` in place (``out=x``) moves only
its rotary channels.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.engine.op_markers import device_marker
from benchmarks.sweep.roofline import Device
from deepinfer.kernels import registry

OP_PREFIX = "op:"  # profiler range of an outermost op call: "op:<name>"
QUANTISED = (torch.float8_e4m3fn, torch.int8, torch.uint8)


@dataclass
class OpWork:
    """Totals over an op's outermost calls."""

    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    floor_s: float = 0.0  # the sum of each call's ceiling time
    rates: set[str] = field(default_factory=set)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, packed rows or a list / tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    data = getattr(value, "data", None)  # PackedRows
    return tensor_bytes(data) if isinstance(data, torch.Tensor) else 0


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _products(name: str, a: dict[str, Any]) -> tuple[float, str, int] | None:
    """(FLOPs, rate, weight bytes) of an op that is counted by its products, else None."""
    if name == "linear":
        x, w = a["x"], a["weight"]
        k = x.shape[-1]
        rate = "fp8" if w.dtype in QUANTISED else "bf16"
        return 2.0 * _rows(x) * w.shape[0] * k, rate, tensor_bytes([w, a.get("scale")])
    if name == "grouped_linear":  # x [T, G, K], weight [G * N, K]
        x, w = a["x"], a["weight"]
        rate = "fp8" if w.dtype in QUANTISED else "bf16"
        flops = 2.0 * x.shape[0] * w.shape[0] * x.shape[-1]
        return flops, rate, tensor_bytes([w, a.get("scale")])
    if name == "fp8_gemm_nt":
        m, k = a["a"].shape
        return 2.0 * m * a["b"].shape[0] * k, "fp8", tensor_bytes([a["b"], a["b_scale"]])
    if name == "fp4_moe_experts":  # gate+up [E, 2I, D/2] and down per routed slot
        x, w13 = a["x"], a["w13"]
        slots = a["topk_ids"].numel()
        flops = 2.0 * slots * 3 * (w13.shape[1] // 2) * x.shape[-1]
        weights = tensor_bytes([w13, a["w13_scale"], a["w2"], a["w2_scale"]])
        return flops, "fp8", weights
    if name == "sparse_mqa_sink":  # q [T, H, D], indices [T, K]: QK and PV per entry
        q = a["q"]
        return 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * a["indices"].shape[1], "bf16", 0
    if name == "indexer_scores":  # q [T, Hi, d] against C candidates
        q = a["q"]
        rate = "fp8" if q.dtype == torch.float8_e4m3fn else "bf16"
        # seq_rows [B, C]; trees before 2026-12-07 passed candidates [T, C] (A/B runs count both)
        candidates = (a["seq_rows"] if "seq_rows" in a else a["candidates"]).shape[1]
        return 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * candidates, rate, 0
    return None


def _moved(name: str, a: dict[str, Any], out: Any) -> int:
    """Bytes a memory-bound op reads and writes: its tensors once each (a returned ``out=``
    buffer once); ``apply_rope(x, out=x)`` reads and writes the rotary channels only."""
    buffer = a.get("out")
    x = a.get("x")
    if (
        name == "apply_rope"
        and buffer is not None
        and x is not None
        and buffer.data_ptr() == x.data_ptr()
    ):
        cos = a["cos"]
        rotary = x.numel() // x.shape[-1] * 2 * cos.shape[-1] * x.element_size()
        return 2 * rotary + tensor_bytes([cos, a["sin"]])
    if buffer is not None and buffer is out:
        a = {k: v for k, v in a.items() if k != "out"}
    return tensor_bytes(list(a.values())) + tensor_bytes(out)


def count(name: str, args: tuple, kwargs: dict, out: Any, device: Device) -> OpWork:
    """The work of one call of op ``name`` and its ceiling time on ``device``."""
    try:
        arguments = inspect.signature(registry.OPS[name].contract).bind(*args, **kwargs).arguments
    except TypeError:  # a backend's extra keyword: count the tensors as bytes
        arguments = {"args": args, **kwargs}
    products = _products(name, arguments) if "args" not in arguments else None
    if products is None:
        moved = _moved(name, arguments, out)
        return OpWork(1, 0.0, float(moved), moved / device.bandwidth, {"bytes"})
    flops, rate, weight_bytes = products
    per_s = device.flops if rate == "fp8" else device.attention_flops or device.flops
    floor = max(flops / per_s, weight_bytes / device.bandwidth)
    return OpWork(1, flops, float(weight_bytes), floor, {rate})


class OpRecorder:
    """Inside ``with recorder.active():`` every outermost op call runs in a profiler range
    ``op:<name>`` and adds its counted work to ``recorder.work[name]``; op calls made inside
    another op's implementation belong to that op."""

    def __init__(self, device: Device, markers: torch.device | str | None = None) -> None:
        """``markers``: a CUDA device to mark each call's kernels on (``op_markers``); the
        calls' names are then kept in launch order in ``calls``."""
        self.device = device
        self.work: dict[str, OpWork] = {}
        self.calls: list[str] = []
        self._mark = device_marker(markers) if markers is not None else None
        self._depth = 0

    def _wrap(self, name: str, impl):
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return impl(*args, **kwargs)
            self._depth += 1
            if self._mark is not None:
                self.calls.append(name)
                self._mark(False)
            try:
                with torch.profiler.record_function(OP_PREFIX + name):
                    out = impl(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._mark is not None:
                    self._mark(True)
            one = count(name, args, kwargs, out, self.device)
            total = self.work.setdefault(name, OpWork())
            total.calls += 1
            total.flops += one.flops
            total.bytes += one.bytes
            total.floor_s += one.floor_s
            total.rates |= one.rates
            return out

        return call

    @contextlib.contextmanager
    def active(self) -> Iterator[OpRecorder]:
        original = registry.resolve
        registry.resolve = lambda name, args=(): self._wrap(name, original(name, args))
        try:
            yield self
        finally:
            registry.resolve = original
