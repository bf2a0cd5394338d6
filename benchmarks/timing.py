"""The one way the engine benchmarks time a call (the sweep's prefill points, ``bench_engine``'s
rows), so their numbers can be compared.

What is timed: the whole call, e.g. one ``LLM.generate``: host scheduling, every forward step,
sampling and output processing, i.e. what a user of the engine waits for. The device is
synchronised before and after each call, so the wall time covers all the device work the call
queued. ``warmup`` calls with the same inputs come first and are not timed: one-off work on a
new shape (Triton compiling kernels for a new tile choice or integer specialisation, the
allocator growing its pool) must never land in a measurement. The result is the median of
``repeats`` calls; on CUDA each call's span is also taken from device events recorded on the
current stream around it (``device_s``), which differs from the wall time only by the host
time before the first and after the last queued kernel.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

INCLUDED = "whole call: host scheduling, forward steps, sampling, output processing"


@dataclass(frozen=True)
class CallTiming:
    """Seconds of the timed calls, in run order, and how they were taken."""

    samples_s: tuple[float, ...]
    device_s: tuple[float, ...] | None  # CUDA-event span of each call; None off CUDA
    warmup: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    def record(self) -> dict[str, Any]:
        """The JSON fields every benchmark row that used this timing carries."""
        device = None if self.device_s is None else statistics.median(self.device_s)
        return {"seconds": self.median_s, "samples_s": list(self.samples_s),
                "device_s": device, "warmup": self.warmup, "timed": INCLUDED}  # fmt: skip


def time_call(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> CallTiming:
    """Time ``fn()`` as the module docstring says: ``warmup`` untimed calls, then ``repeats``
    timed ones, each between two device synchronisations."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"time_call: got warmup={warmup}, repeats={repeats}; expected >= 0, >= 1")
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    samples, spans = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        start = time.perf_counter()
        fn()
        if cuda:
            end_event.record()
            torch.cuda.synchronize()
            spans.append(start_event.elapsed_time(end_event) * 1e-3)
        samples.append(time.perf_counter() - start)
    return CallTiming(tuple(samples), tuple(spans) if cuda else None, warmup)
