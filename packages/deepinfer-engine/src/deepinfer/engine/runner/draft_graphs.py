"""CUDA graphs of the DSpark drafter: every stage of a proposal, for all its requests, in one
replay.

A proposal of ``B`` requests runs the draft block (``K`` tokens per request: the anchor, then
the noise token) through every stage, the last stage's collapse, norm and the shared head:
fixed shapes once ``B`` is rounded up to a capture size (:func:`graph_batch_size`), since each
block token attends to the ``sliding_window`` ring rows of its request's main positions and to
the ``K`` rows of its block whatever the context length. The graph's outputs are the last
stage's hidden rows (the confidence head reads them) and the base logits; the Markov head and
the picking of each draft stay eager (:meth:`DSparkDraft.markov_decode`): draft ``i + 1``'s
correction depends on draft ``i``, which the request's own sampling pipeline picks (penalties
over its history and grammar matchers advanced draft by draft on the host, seeded or rejection
draws), a ``[B, vocab]`` correction and a pick per draft position, small next to the stages;
the picks are read back once per proposal unless a grammar or penalty needs them. When every
request of the proposal is plain greedy (no grammar, no logit processing: its pick is the
argmax), the graph of that key (``greedy=True``) runs the Markov head and the picks too, and
returns the drafts and their confidence logits: the whole proposal is one replay and one read.

A graph's inputs are four numbers per request (:class:`DraftLayout`); the block's ids,
positions and window rows are computed from them inside the graph. :meth:`DraftGraphs.run`
takes them from the host; :meth:`DraftGraphs.run_on_device` takes the anchors and last
positions as device tensors, so a verification step can draft from its outcome before the host
has read it (the runner's greedy chain).

Padding requests copy the first request (anchor, last position, the window it reads) and write
their block rows to the scratch state slot 0, so the real requests' rows and rings are the
eager proposal's, as far as an op's result for a row does not depend on the row count (always
so in batch-invariant mode). ``capture=False`` runs the same fixed-shape forward eagerly (the
CPU tests check it against the eager proposal).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import AttentionMetadata
from deepinfer.engine.model.mtp_window import check_ring, draft_block
from deepinfer.engine.runner.cuda_graphs import capture_graph, graph_batch_size
from deepinfer.engine.runner.decode_metadata import SCRATCH_SLOT, flat_views

logger = logging.getLogger(__name__)


@dataclass
class DraftLayout:
    """The inputs of a draft block of ``num_requests`` requests, ``block_size`` tokens each
    (request-major), over rings of ``ring_size`` rows in ``num_slots`` slots: per request its
    anchor token, the last position its window was seeded at, the state slot whose window it
    reads and the one its block rows are written to (slot 0, the scratch slot, for padding),
    in a flat int64 buffer of ``4 * num_requests``. The block's ids, positions and attention
    metadata are computed from them on the buffer's device (:meth:`inputs`, inside a graph
    when captured), so a proposal copies ``4 * B`` numbers to the device, and a step that knows
    its anchors only on the device writes them there (:meth:`DraftGraphs.run_on_device`)."""

    num_requests: int
    block_size: int
    window: int
    ring_size: int
    num_slots: int
    noise_token_id: int
    fields: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    size: int = 0

    def __post_init__(self) -> None:
        check_ring(self.ring_size, self.window, self.block_size)
        n = self.num_requests
        for name in ("anchors", "last_positions", "read_slots", "write_slots"):
            self.fields[name] = (self.size, (n,))
            self.size += n

    def views(self, flat):
        return flat_views(self.fields, flat)

    def fill(self, out: np.ndarray, anchors, last_positions, slots) -> None:
        """Write the block of ``B <= num_requests`` requests into ``out``: request ``b``'s
        anchor token, the last position its window was seeded at, its state slot; padding
        requests copy request 0 and write to the scratch slot."""
        n = self.num_requests
        b = len(slots)
        if not 0 < b <= n:
            raise ValueError(f"draft block of {b} requests: this layout has {n}")
        v = self.views(out)
        for name, values in (("anchors", anchors), ("last_positions", last_positions),
                             ("read_slots", slots)):  # fmt: skip
            v[name][:b] = values
            v[name][b:] = values[0]
        v["write_slots"][:b] = slots
        v["write_slots"][b:] = SCRATCH_SLOT

    def inputs(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(block token ids, positions, draft metadata) computed from the buffer on its device
        (:func:`.mtp_window.draft_block`)."""
        v = self.views(flat)
        return draft_block(v["anchors"], v["last_positions"], v["read_slots"], self.block_size,
                           self.noise_token_id, self.window, self.ring_size, self.num_slots,
                           v["write_slots"])  # fmt: skip


@dataclass
class _Graph:
    layout: DraftLayout
    host_view: np.ndarray
    host: torch.Tensor
    device: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None


class DraftGraphs:
    """Graphs of the DSpark stages of ``model`` over ``cache`` (see the module docstring);
    ``pool``: the memory pool to share (the step graphs', which never run at the same time)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: ModelCache,
        block_size: int,
        *,
        max_requests: int,
        capture: bool = True,
        pool=None,
    ) -> None:
        self.model, self.cache, self.block_size = model, cache, block_size
        self.device = next(iter(cache.tensors.values())).device
        self.max_requests, self.capture = max_requests, capture
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.failed: set[tuple[int, bool]] = set()
        self.num_replays = 0
        c = model.config
        self._layout = partial(DraftLayout, block_size=block_size, window=c.sliding_window,
                               ring_size=cache.ring_size, num_slots=cache.layout.num_slots,
                               noise_token_id=c.dspark_noise_token_id)  # fmt: skip
        size = self._layout(max_requests).size
        pin = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._device = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._outputs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pads: dict[tuple[int, int], torch.Tensor] = {}  # (graph size, B) -> row index

    @staticmethod
    def reserve_bytes(config, max_requests: int, block_size: int) -> int:
        """Device memory of the graphs' shared outputs (hidden rows, fp32 base logits)."""
        rows = max_requests * block_size
        return rows * (config.vocab_size * 4 + config.hidden_size * 4)

    def key(self, num_requests: int, greedy: bool = False) -> tuple[int, bool] | None:
        if not 0 < num_requests <= self.max_requests:
            return None
        key = (graph_batch_size(num_requests, self.max_requests), greedy)
        return None if key in self.failed else key

    def replays(self, num_requests: int, greedy: bool = False) -> bool:
        """Whether a proposal of ``num_requests`` replays an already captured graph."""
        entry = self.graphs.get(self.key(num_requests, greedy))
        return entry is not None and entry.graph is not None

    def run(self, anchors, last_positions, slots, greedy: bool = False):
        """The requests' draft block (valid until the next proposal), or None: propose
        eagerly. ``greedy=False``: (hidden ``[B*K, D]``, base logits ``[B*K, vocab]`` fp32,
        anchors ``[B]``); ``greedy=True`` (every request plain greedy): (drafts ``[B, K]``
        int64, confidence logits ``[B, K]`` fp32)."""
        entry = self._entry(len(slots), greedy)
        if entry is None:
            return None
        entry.layout.fill(entry.host_view, anchors, last_positions, slots)
        entry.device.copy_(entry.host, non_blocking=True)
        return self._replay(entry, len(slots), greedy)

    def run_on_device(self, anchors: torch.Tensor, last_positions: torch.Tensor, slots,
                      greedy: bool = False):  # fmt: skip
        """:meth:`run` with the anchors and last positions given as ``[B]`` int64 tensors on
        the device (a verification step's outcome, not read back), queued without a host
        sync; the slots are the host's."""
        b = len(slots)
        entry = self._entry(b, greedy)
        if entry is None:
            return None
        entry.layout.fill(entry.host_view, [0] * b, [0] * b, slots)
        entry.device.copy_(entry.host, non_blocking=True)
        v = entry.layout.views(entry.device)
        n = entry.layout.num_requests
        pad = self._pads.get((n, b))
        if pad is None:  # padding requests copy request 0
            index = torch.zeros(n, dtype=torch.long)
            index[:b] = torch.arange(b)
            pad = self._pads[n, b] = index.to(self.device, non_blocking=True)
        v["anchors"].copy_(anchors[pad])
        v["last_positions"].copy_(last_positions[pad])
        return self._replay(entry, b, greedy)

    def _entry(self, num_requests: int, greedy: bool) -> _Graph | None:
        key = self.key(num_requests, greedy)
        if key is None:
            return None
        return self.graphs.get(key) or self._new(key)

    def _replay(self, entry: _Graph, b: int, greedy: bool):
        key = (entry.layout.num_requests, greedy)
        if not self.capture:
            outputs = self._forward(entry, greedy)
        else:
            if entry.graph is None and not self._capture(key, entry):
                return None
            entry.graph.replay()
            self.num_replays += 1
            outputs = entry.outputs
        if greedy:
            return outputs[0][:b], outputs[1][:b]
        rows = b * self.block_size
        anchor_view = entry.layout.views(entry.device)["anchors"][:b]
        return outputs[0][:rows], outputs[1][:rows], anchor_view

    def _new(self, key: tuple[int, bool]) -> _Graph:
        layout = self._layout(key[0])
        host, device = self._host[: layout.size], self._device[: layout.size]
        entry = _Graph(layout, host.numpy(), host, device)
        self.graphs[key] = entry
        return entry

    def _forward(self, entry: _Graph, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        ids, positions, md = entry.layout.inputs(entry.device)
        streams, ctx = m.mtp.block_context(ids, positions, md, self.cache, m.embed, m.rope)
        hidden, base = m.mtp.block_logits(streams, ctx, m.head.weight)
        if not greedy:
            return hidden, base
        anchors = entry.layout.views(entry.device)["anchors"]
        drafted = m.mtp.markov_decode(hidden, base, anchors, self.block_size)  # argmax picks
        return drafted.tokens, drafted.confidence_logits

    def _shared_outputs(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the output buffers every graph of ``key``'s kind copies its results to:
        drafts and confidence logits (greedy), else hidden rows (fp32: exact, and the
        confidence head reads them as fp32 anyway) and base logits."""
        size, greedy = key
        if greedy not in self._outputs:
            n, k, c = self.max_requests, self.block_size, self.model.config
            empty = partial(torch.empty, device=self.device)
            if greedy:
                pair = (empty((n, k), dtype=torch.long), empty((n, k), dtype=torch.float32))
            else:
                pair = (empty((n * k, c.hidden_size), dtype=torch.float32),
                        empty((n * k, c.vocab_size), dtype=torch.float32))  # fmt: skip
            self._outputs[greedy] = pair
        rows = size if greedy else size * self.block_size
        return self._outputs[greedy][0][:rows], self._outputs[greedy][1][:rows]

    def _capture(self, key: tuple[int, bool], entry: _Graph) -> bool:
        """Capture ``entry``'s forward (its block rows rewrite the same ring rows each run, so
        the warm-up needs no undo); False if the capture failed (that key then runs eagerly)."""
        try:
            outputs = self._shared_outputs(key)
            forward = partial(self._forward, entry, key[1])
            graph = capture_graph(self.device, self.pool, forward, forward, outputs)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run eagerly
            self.failed.add(key)
            self.graphs.pop(key, None)
            logger.warning("draft graph %s: capture failed, proposing eagerly (%s)", key, error)
            return False
        entry.graph, entry.outputs = graph, outputs
        logger.info("captured the draft graph of %d requests (greedy picks: %s)", *key)
        return True
