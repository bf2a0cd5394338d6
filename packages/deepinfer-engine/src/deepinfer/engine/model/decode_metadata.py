"""Fixed-shape metadata of a decode step, for CUDA-graph capture and replay.

A decode step (every sequence one token, no drafts) of ``T`` tokens whose contexts are at most
``context`` positions long, ``E_k`` of which complete an entry of compressed kind ``k``, always
has index lists of the same shapes: ``T`` token rows, ``E_k`` entry rows, ``sliding_window``
window columns, ``context // ratio`` visible columns per kind.
:class:`DecodeLayout` fixes those shapes; :meth:`DecodeLayout.fill` writes one step's values
(plain integers in, numpy on the host, no torch op) into one flat int64 host buffer, which one
copy moves into the device buffer a captured graph reads (:meth:`DecodeLayout.metadata` views).

Differences from :func:`.metadata.build_metadata`, none of which changes a value attention
reads or the order it reads them in (so the logits are bit-identical):

- ``fixed=True``: attention writes the step's KV rows into the window rings *before* reading,
  and ``window_indices`` are ring rows only (the row a token's KV overwrites holds a position
  ``ring >= window`` back, outside every window of the step); attention then gathers the rows
  each query reads into one fixed-size buffer instead of concatenating the pools.
- the layout fixes how many tokens complete an entry of each kind (a separate graph per
  count: in steady decode the count cycles through at most ``ratio`` values), so the plans'
  entry rows are exactly the eager ones;
- ``visible`` is padded with ``-1`` to ``context // ratio`` columns (the attention and indexer
  kernels skip ``-1``; trailing ones add exact zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.model.cache import CacheLayout, compressor_state_rows, overlapped
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.metadata import AttentionMetadata, CompressionPlan, ForwardBatch


@dataclass(frozen=True)
class _Kind:
    ratio: int
    overlap: bool
    state_rows: int


def compression_kinds(config: ModelConfig, max_draft: int) -> list[_Kind]:
    """The step's compressed-cache kinds, in the order of the metadata's plans."""
    c = config
    kinds = {
        (c.compress_ratios[i], overlapped(c, i)): _Kind(
            c.compress_ratios[i], overlapped(c, i), compressor_state_rows(c, i, max_draft)
        )
        for i in range(c.num_layers)
        if c.compress_ratios[i] > 0
    }
    return [kinds[key] for key in sorted(kinds)]


def emitting(kinds: list[_Kind], positions) -> tuple[int, ...]:
    """Per kind: how many tokens at ``positions`` complete an entry of that kind."""
    p = np.asarray(positions, dtype=np.int64)
    return tuple(int(((p + 1) % k.ratio == 0).sum()) for k in kinds)


@dataclass
class DecodeLayout:
    """Shapes and flat-buffer offsets of the fixed metadata of ``num_tokens`` decode tokens
    with contexts of at most ``context`` positions, of which ``emits[k]`` (default: all)
    complete an entry of kind ``k``: the kind's plan has exactly that many entry rows, as the
    eager step's has, so every op after the pooling (V4.1's dense key projection included)
    sees the eager shapes."""

    config: ModelConfig
    cache_layout: CacheLayout
    ring_size: int
    num_tokens: int
    context: int
    emits: tuple[int, ...] | None = None
    fields: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    size: int = 0

    def __post_init__(self) -> None:
        c, t = self.config, self.num_tokens
        self.kinds = compression_kinds(c, self.cache_layout.max_draft)
        if self.emits is None:
            self.emits = (t,) * len(self.kinds)
        w = c.sliding_window
        for name, shape in (("input_ids", (t,)), ("positions", (t,)), ("seq_lens", (t,)),
                            ("state_slots", (t,)), ("rows", (t,)), ("cu_seqlens_q", (t + 1,)),
                            ("window_indices", (t, w)), ("window_gather", (t, w)),
                            ("window_write_dst", (t,))):  # fmt: skip
            self._add(name, shape)
        for k, e in zip(self.kinds, self.emits, strict=True):
            p = f"{k.ratio}.{int(k.overlap)}."
            width = 2 * k.ratio if k.overlap else k.ratio
            for name, shape in (("emit_src", (e, width)), ("emit_positions", (e,)),
                                ("emit_rows", (e,)), ("state_write_dst", (t,)),
                                ("visible", (t, self.context // k.ratio)),
                                ("visible_count", (t,))):  # fmt: skip
                self._add(p + name, shape)

    def _add(self, name: str, shape: tuple[int, ...]) -> None:
        self.fields[name] = (self.size, shape)
        self.size += int(np.prod(shape))

    def views(self, flat):
        """``name -> view`` of a flat buffer (numpy array or tensor) laid out as ``fields``."""
        return {
            name: flat[offset : offset + int(np.prod(shape))].reshape(shape)
            for name, (offset, shape) in self.fields.items()
        }

    def fits(self, num_tokens: int, max_seq_len: int) -> bool:
        return num_tokens == self.num_tokens and max_seq_len <= self.context

    def fill(self, out: np.ndarray, input_ids, positions, block_tables, state_slots) -> None:
        """Write one decode step into ``out`` (int64 ``[size]``): token ``t`` of sequence
        ``t`` is ``input_ids[t]`` at ``positions[t]`` with ``block_tables[t]`` (padded rows)
        and state slot ``state_slots[t]``."""
        c, t, v = self.config, self.num_tokens, self.views(out)
        p = np.asarray(positions, dtype=np.int64)
        s = np.asarray(state_slots, dtype=np.int64)
        tables = np.asarray(block_tables, dtype=np.int64).reshape(t, -1)
        if len(p) != t or int(p.max()) + 1 > self.context:
            raise ValueError(f"decode step of {len(p)} tokens up to position {int(p.max())} "
                             f"does not fit {t} tokens of context {self.context}")  # fmt: skip
        rows = np.arange(t)
        v["input_ids"][:] = input_ids
        v["positions"][:] = p
        v["seq_lens"][:] = p + 1
        v["state_slots"][:] = s
        v["rows"][:] = rows
        v["cu_seqlens_q"][:] = np.arange(t + 1)
        ring, w = self.ring_size, c.sliding_window
        q = p[:, None] - w + 1 + np.arange(w)
        v["window_indices"][:] = np.where(q >= 0, s[:, None] * ring + q % ring, -1)
        v["window_gather"][:] = np.where(q >= 0, (rows[:, None] * w + np.arange(w)), -1)
        v["window_write_dst"][:] = s * ring + p % ring
        for k, count in zip(self.kinds, self.emits, strict=True):
            self._fill_kind(v, f"{k.ratio}.{int(k.overlap)}.", k, count, p, s, tables)

    def _fill_kind(self, v, prefix: str, k: _Kind, count: int, p, s, tables) -> None:
        r = k.ratio
        emits = np.flatnonzero((p + 1) % r == 0)  # the tokens completing an entry, in order
        if len(emits) != count:
            raise ValueError(f"{len(emits)} tokens complete a ratio-{r} entry: this layout "
                             f"has {count} entry rows")  # fmt: skip
        v[prefix + "state_write_dst"][:] = s * k.state_rows + p % k.state_rows
        counts = (p + 1) // r
        entries = np.arange(self.context // r)[None, :]
        visible = _arena_rows(tables, np.broadcast_to(entries, (len(p), entries.shape[1])), r,
                              self.cache_layout)  # fmt: skip
        v[prefix + "visible"][:] = np.where(entries < counts[:, None], visible, -1)
        v[prefix + "visible_count"][:] = counts
        if not count:
            return
        base = self.cache_layout.num_slots * k.state_rows
        pe, se = p[emits], s[emits]
        entry = (pe + 1) // r - 1
        first = (entry - 1) * r if k.overlap else entry * r
        q = first[:, None] + np.arange(2 * r if k.overlap else r)
        # rows of [state | step tokens]: the completing token itself, else its state ring
        src = np.where(q >= pe[:, None], base + emits[:, None] + q - pe[:, None],
                       se[:, None] * k.state_rows + q % k.state_rows)  # fmt: skip
        v[prefix + "emit_src"][:] = np.where(q < 0, -1, src)
        v[prefix + "emit_positions"][:] = entry * r
        v[prefix + "emit_rows"][:] = _arena_rows(tables[emits], entry[:, None], r,
                                                 self.cache_layout)[:, 0]  # fmt: skip

    def metadata(self, flat: torch.Tensor) -> tuple[ForwardBatch, AttentionMetadata]:
        """The batch and metadata the forward reads, as views of the device buffer ``flat``
        (valid for every later :meth:`fill` copied into it)."""
        v = self.views(flat)
        batch = ForwardBatch(
            input_ids=v["input_ids"],
            positions=v["positions"],
            cu_seqlens_q=v["cu_seqlens_q"],
            seq_lens=v["seq_lens"],
            block_tables=v["state_slots"][:, None],  # unused: the metadata is given
            state_slots=v["state_slots"],
            logits_indices=v["rows"],
        )
        plans = {}
        for k in self.kinds:
            p = f"{k.ratio}.{int(k.overlap)}."
            plans[(k.ratio, k.overlap)] = CompressionPlan(
                ratio=k.ratio,
                state_rows=k.state_rows,
                emit_src=v[p + "emit_src"],
                emit_positions=v[p + "emit_positions"],
                emit_rows=v[p + "emit_rows"],
                state_write_src=v["rows"],
                state_write_dst=v[p + "state_write_dst"],
                visible=v[p + "visible"],
                visible_count=v[p + "visible_count"],
            )
        md = AttentionMetadata(
            num_tokens=self.num_tokens,
            window_base=self.cache_layout.num_slots * self.ring_size,
            window_indices=v["window_indices"],
            window_write_src=v["rows"],
            window_write_dst=v["window_write_dst"],
            plans=plans,
            window_gather=v["window_gather"],
        )
        return batch, md


def _arena_rows(tables: np.ndarray, entries: np.ndarray, ratio: int, lay: CacheLayout):
    """Arena row of entry ``entries[n, c]`` of sequence ``n`` (blocks past the table: the null
    block, as the runner pads tables with it)."""
    per_block = lay.block_size // ratio
    block = (entries * ratio) // lay.block_size
    width = tables.shape[1]
    ids = np.take_along_axis(tables, np.minimum(block, width - 1), axis=1)
    ids = np.where(block < width, ids, 0)
    return ids * per_block + entries % per_block


def context_bucket(max_seq_len: int, minimum: int) -> int:
    """The smallest power of two >= ``max_seq_len`` and >= ``minimum``."""
    bucket = max(minimum, 1)
    while bucket < max_seq_len:
        bucket *= 2
    return bucket
