"""Decode and verification CUDA graphs: the whole forward of a decode or verification step
captured once per shape, then replayed, so a step costs one graph launch instead of thousands
of kernel launches.

A step qualifies when every scheduled sequence has one token (decode) or, with
``speculative=True``, its last token and its drafts, all sampled (verification: ``1 + k_i``
tokens, ragged under confidence scheduling); no prompt logprobs are asked for, there are at
most ``max_batch_size`` tokens and every context fits ``max_context``. Its shape key is (token
rows: the step's token count rounded up to a capture size, 1, 2, 4, 8 and multiples of 8 up to
``max_batch_size`` (:func:`graph_batch_size`);
context bucket: the smallest power of two at least the longest context and at least
``min_context``; per compressed kind the entry rows: none when no token completes an entry,
as the eager step leaves the pooling out then, else the count rounded up to a power of two).
The padding rows copy the step's first token and write only to the reserved scratch slot and
null block (:mod:`deepinfer.engine.runner.decode_metadata`), so a batch that shrinks as its
sequences finish, with prompts of any lengths, keeps reusing a few dozen graphs instead of
capturing one per sequence count and entry count.

The first step of a key warms the forward up on the fixed-shape metadata, captures it into a
graph that shares one memory pool with the others, and replays it. A real row's logits are the
eager step's but for what the padding rows change in an op's result for that row: nothing on
the reference ops (CPU, bit for bit) nor in batch-invariant mode; otherwise an op may pick
other tiles for a larger row count (GPU: equal greedy tokens in the tests). Any other step, a
key whose capture failed (logged once), and new keys past ``max_graphs`` run eagerly: a step
never fails for want of a graph.

Per step the host fills one pinned int64 buffer (numpy, no torch op per field) and one copy
moves it into the graph's input buffer; every graph shares these two buffers (sized for the
largest layout, ``max_batch_size`` tokens at ``max_context``). Memory: the graphs' pool holds
the activations of one decode forward of at most ``max_batch_size`` tokens (small next to the
prefill activations the cache sizing reserves), plus one shared fp32 logits buffer
``[max_batch_size, vocab]`` and the input buffer (:func:`graph_reserve_bytes` of the loader).

With ``speculative=True`` the forward also seeds the DSpark stages' windows from the step's
taps (the padding rows seed the scratch slot), so the drafter needs nothing else from it.

``padding=False`` keys graphs on the exact token and entry counts instead (no padding rows:
bit-identical to the eager step on any op, at the cost of a capture per count). ``capture=False``
runs the same fixed-shape forward eagerly (any device): the CPU tests use it to check that
forward against the normal one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.engram import EngramTable
from deepinfer.engine.model.moe import MoE
from deepinfer.engine.runner.batch_plan import StepPlan
from deepinfer.engine.runner.decode_metadata import (
    DecodeLayout,
    compression_kinds,
    context_bucket,
    emitting,
    padded_count,
)

logger = logging.getLogger(__name__)


def graph_batch_size(num_tokens: int, max_batch_size: int) -> int:
    """Token rows of the graph a decode step of ``num_tokens`` sequences replays: the next of
    1, 2, 4, 8, 16, 24, ... (multiples of 8), at most ``max_batch_size``."""
    size = 1 << (num_tokens - 1).bit_length() if num_tokens <= 8 else -(-num_tokens // 8) * 8
    return min(size, max_batch_size)


@dataclass
class _Graph:
    layout: DecodeLayout
    host: torch.Tensor  # [size] int64, pinned on CUDA
    host_view: np.ndarray
    device: torch.Tensor  # [size] int64, the graph's input buffer
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # graph output (a view of the shared buffer)


class DecodeGraphs:
    """Decode- and verification-step graphs of ``model`` over ``cache`` (see the module
    docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: ModelCache,
        *,
        max_batch_size: int,
        max_context: int,
        min_context: int = 1024,
        capture: bool = True,
        max_graphs: int = 512,
        padding: bool = True,
        speculative: bool = False,
    ) -> None:
        self.model, self.cache = model, cache
        self.speculative = speculative
        self.device = next(iter(cache.tensors.values())).device
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.min_context = min(min_context, max_context)
        self.capture, self.max_graphs, self.padding = capture, max_graphs, padding
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: set[tuple] = set()
        self.num_replays = 0
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.kinds = compression_kinds(model.config, cache.layout.max_draft)
        self._logits: torch.Tensor | None = None
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._filled: tuple | None = None  # the key whose layout last filled the host buffer
        self._shape: tuple = (None, None, None)  # (plan, rows, its shape key): the last asked

    @staticmethod
    def input_elements(config, cache_layout: CacheLayout, max_batch_size: int,
                       max_context: int, min_context: int = 1024) -> int:  # fmt: skip
        """int64 elements of the input buffer every graph shares: its largest layout's."""
        bucket = context_bucket(max_context, min(min_context, max_context))
        ring = config.sliding_window + cache_layout.max_draft
        return DecodeLayout(config, cache_layout, ring, max_batch_size, bucket).size

    def _shared_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pinned host, device) int64 buffers that every graph reads its inputs from: one
        step runs at a time and fills every field of its layout first, so they can share."""
        if self._inputs is None:
            size = self.input_elements(self.model.config, self.cache.layout,
                                       self.max_batch_size, self.max_context, self.min_context)  # fmt: skip
            pin = self.device.type == "cuda"
            host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
            self._inputs = (host, torch.zeros(size, dtype=torch.int64, device=self.device))
        return self._inputs

    @staticmethod
    def supports(model: torch.nn.Module, device: torch.device) -> bool:
        """Whether ``model``'s forward can be captured on ``device``: a CUDA device and no host
        loop in the model (dense or FP8 experts run a loop over the routed experts; expert
        parallel layers read their all-to-all sizes on the host; host Engram tables gather rows
        on the host)."""
        if device.type != "cuda":
            return False
        if any(isinstance(m, EngramTable) and m.host for m in model.modules()):
            return False  # its rows are gathered on the host each step
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        return all(m.uses_grouped_experts(device) and m.ep is None for m in moes)

    def key(self, plan: StepPlan, rows: list[int]) -> tuple | None:
        """The graph key of ``plan``, or None when the step must run eagerly."""
        if self._shape[0] is not plan or self._shape[1] is not rows:  # asked twice a step
            self._shape = (plan, rows, self._shape_key(plan, rows))
        key = self._shape[2]
        if key is None or key in self.failed:
            return None
        if key not in self.graphs and len(self.graphs) >= self.max_graphs:
            return None  # (past max_graphs new shapes run eagerly: bounded graph memory)
        return key

    def _shape_key(self, plan: StepPlan, rows: list[int]) -> tuple | None:
        t = plan.num_tokens
        if not 0 < t <= self.max_batch_size or plan.prompt_logprob_rows or len(rows) != t:
            return None  # (every row sampled: one token, or the last one and its drafts, each)
        if not self.speculative and (len(plan.seq_lens) != t or any(plan.num_drafts)):
            return None
        longest = max(plan.seq_lens)
        if longest > self.max_context:
            return None
        size = graph_batch_size(t, self.max_batch_size) if self.padding else t
        emits = emitting(self.kinds, plan.positions)
        if self.padding:
            emits = tuple(padded_count(e, size) for e in emits)
        return (size, context_bucket(longest, self.min_context), emits)

    def run(self, plan: StepPlan, rows: list[int], feed=None) -> torch.Tensor | None:
        """Logits ``[T, vocab]`` fp32 of a qualifying decode or verification step (valid until
        the next step), or None: the caller runs the step eagerly. ``feed``: (rows ``[F]``,
        tokens ``[F]``) device tensors, input tokens written over the plan's after its copy
        (tokens the previous step sampled that the host has not read yet)."""
        key = self.key(plan, rows)
        if key is None:
            return None
        entry = self.graphs.get(key) or self._new(key)
        refill, self._filled = self._filled == key, None  # the shared buffer's last layout
        self.load(entry, plan, feed, refill=refill)
        self._filled = key
        if not self.capture:
            return self._forward(entry)[: plan.num_tokens]
        if entry.graph is None and not self._capture(key, entry):
            return None
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits[: plan.num_tokens]

    def load(self, entry: _Graph, plan: StepPlan, feed=None, *, refill: bool = False) -> None:
        """Lay ``plan`` out in ``entry``'s buffers and queue the copy to the device, then write
        the ``feed`` tokens over the copied ones (padding rows copy row 0's token, as
        :meth:`DecodeLayout.fill` lays them out)."""
        entry.layout.fill(entry.host_view, plan.input_ids, plan.positions, plan.block_tables,
                          plan.state_slots, plan.cu_seqlens_q, refill=refill)  # fmt: skip
        entry.device.copy_(entry.host, non_blocking=True)
        if feed is None:
            return
        ids = entry.layout.views(entry.device)["input_ids"]
        ids.index_copy_(0, *feed)
        t = plan.num_tokens
        if t < ids.shape[0]:
            ids[t:].copy_(ids[0].expand(ids.shape[0] - t))

    def _new(self, key: tuple) -> _Graph:
        t, context, emits = key
        layout = DecodeLayout(self.model.config, self.cache.layout, self.cache.ring_size, t,
                              context, emits)  # fmt: skip
        host, device = (buffer[: layout.size] for buffer in self._shared_inputs())
        entry = _Graph(layout, host, host.numpy(), device)
        self.graphs[key] = entry
        return entry

    def _forward(self, entry: _Graph) -> torch.Tensor:
        batch, metadata = entry.layout.metadata(entry.device)
        step = self.model.forward_step(batch, self.cache, metadata)
        if self.speculative:
            write_slots = entry.layout.views(entry.device)["write_slots"]
            self.model.mtp.seed(step.taps, batch.positions, write_slots, self.cache,
                                self.model.rope)  # fmt: skip
        return step.logits

    def warm_up(self, entry: _Graph) -> None:
        """Run ``entry``'s forward once before its capture (compiles kernels, creates library
        handles), leaving the cache as the step found it.

        The KV, window-ring and compressor writes repeat identically when the step then runs,
        but the Engram history (``cache.extra``) does not: a token's write can land in the ring
        cell its own oldest look-back reads (the ring holds ``N - 1`` positions without
        speculation), so it is put back after the warm-up.
        """
        saved = {name: t.clone() for name, t in self.cache.extra.items()}
        self._forward(entry)
        for name, t in self.cache.extra.items():
            t.copy_(saved[name])

    def _capture(self, key: tuple, entry: _Graph) -> bool:
        """Warm up (:meth:`warm_up`) and capture ``entry``'s forward (its buffers hold the
        current step); False if the capture failed (the key then always runs eagerly)."""
        try:
            if self._logits is None:
                vocab = self.model.config.vocab_size
                self._logits = torch.empty((self.max_batch_size, vocab), dtype=torch.float32,
                                           device=self.device)  # fmt: skip
            out = self._logits[: key[0]]
            graph = capture_graph(self.device, self.pool, partial(self.warm_up, entry),
                                  lambda: (self._forward(entry),), (out,))  # fmt: skip
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            self.failed.add(key)
            self.graphs.pop(key, None)
            logger.warning("step graph %s: capture failed, running eagerly (%s)", key, error)
            return False
        entry.graph, entry.logits = graph, out
        logger.info("captured the step graph of %d tokens, context %d, entries %s", *key)
        return True


def capture_graph(
    device: torch.device,
    pool,
    warm_up: Callable[[], object],
    forward: Callable[[], tuple[torch.Tensor, ...]],
    outputs: tuple[torch.Tensor, ...],
) -> torch.cuda.CUDAGraph:
    """Run ``warm_up`` on a side stream (kernels compiled, handles created before capture),
    then capture ``forward`` into a graph of ``pool`` that copies its results into
    ``outputs`` (buffers that outlive the capture, shared by the graphs of one kind)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for out, value in zip(outputs, forward(), strict=True):
            out.copy_(value)
    return graph
