"""CUDA graphs of the sampler's device work, so a step pays one graph launch instead of the
Triton and torch launches of the draw (a dozen host-side launches of ~10-40 us each on the H200).

A graph records kernels with fixed addresses and sizes, so it is keyed by everything they
read: the logits' address, shape, stride and dtype; the device; the per-row buffer
(``rows.device_rows``: fixed per rows x device x stream); the RNG stream id; whether some rows
are greedy; and the kernel backend. The kernels hold no host-side branch on the data (every
data-dependent path is inside them), so a replay launches exactly what an eager call would:
the results are bit-identical. A replay reads whatever is at those addresses when it runs, so
the same key always means the same inputs.

Policy: a key runs eagerly the first time it is seen and is captured the second time (a
shape seen once never pays a capture); at most ``MAX_GRAPHS`` graphs are kept (least recently
used first out) and at most ``MAX_CAPTURES`` are ever made in a process (so logits at a new
address every step cannot turn every step into a capture). A capture that fails turns graphs
off for the process, with one warning. ``DEEPINFER_ENFORCE_EAGER=1`` turns them off too.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from deepinfer.kernels import envs, registry

logger = logging.getLogger("deepinfer.sampling")

MAX_GRAPHS = 8
MAX_CAPTURES = 64
_MAX_SEEN = 256  # keys remembered as seen once


@dataclass
class GraphPolicy:
    """Which keys to capture: the second sighting, within the budgets. Plain data (testable
    without a GPU): ``decide`` returns ``"eager"``, ``"capture"`` or ``"replay"``."""

    max_graphs: int = MAX_GRAPHS
    max_captures: int = MAX_CAPTURES
    captured: OrderedDict = field(default_factory=OrderedDict)  # key -> graph entry, LRU order
    seen: OrderedDict = field(default_factory=OrderedDict)  # keys seen once
    num_captures: int = 0
    disabled: bool = False

    def decide(self, key: Hashable) -> str:
        if key in self.captured:
            self.captured.move_to_end(key)
            return "replay"
        if self.disabled or self.num_captures >= self.max_captures:
            return "eager"
        if key in self.seen:
            del self.seen[key]
            return "capture"
        self.seen[key] = True
        if len(self.seen) > _MAX_SEEN:
            self.seen.popitem(last=False)
        return "eager"

    def store(self, key: Hashable, entry) -> None:
        self.num_captures += 1
        self.captured[key] = entry
        while len(self.captured) > self.max_graphs:
            self.captured.popitem(last=False)


@dataclass(frozen=True)
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the graph's static result
    keep_alive: tuple  # static inputs the graph reads (the row buffer)


_policy = GraphPolicy()
_lock = threading.Lock()


def graphs_enabled(logits: torch.Tensor) -> bool:
    return (
        logits.is_cuda
        and not _policy.disabled
        and not envs.get("DEEPINFER_ENFORCE_EAGER")
        and not torch.cuda.is_current_stream_capturing()
    )


def graph_key(logits: torch.Tensor, rows_buffer: torch.Tensor, *extra: Hashable) -> tuple:
    """The row buffer's address stands for the stream too: buffers are kept per stream, and a
    graph keeps its buffer alive, so no other stream's buffer can take that address."""
    return (
        logits.data_ptr(), tuple(logits.shape), logits.stride(0), logits.dtype, logits.device,
        rows_buffer.data_ptr(), id(registry.active()), *extra,
    )  # fmt: skip


def _capture(body: Callable[[], torch.Tensor], device: torch.device) -> tuple:
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):  # warm-up off the capture (lazy loads, allocator)
        body()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        output = body()
    return graph, output


def run_graphed(
    key: Hashable, body: Callable[[], torch.Tensor], device: torch.device, keep_alive: tuple
) -> torch.Tensor:
    """``body()``'s result through a graph for ``key`` (replayed, captured now, or eager per
    the policy). ``body`` must read only the static inputs the key names. The result is a
    fresh tensor (the graph's own output is copied out)."""
    with _lock:
        action = _policy.decide(key)
        if action == "capture":
            try:
                graph, output = _capture(body, device)
            except Exception as e:  # graphs are an optimisation: fall back, say so once
                _policy.disabled = True
                logger.warning("sampler CUDA graph capture failed, running eagerly: %s", e)
                return body()
            _policy.store(key, _Entry(graph, output, keep_alive))
            action = "replay"
        entry = _policy.captured.get(key) if action == "replay" else None
    if entry is None:
        return body()
    entry.graph.replay()
    return entry.output.clone()


def reset() -> None:
    """Drop every graph and the policy's memory (tests, or to free the graphs' pools)."""
    global _policy
    with _lock:
        _policy = GraphPolicy()


__all__ = ["GraphPolicy", "graph_key", "graphs_enabled", "reset", "run_graphed"]
