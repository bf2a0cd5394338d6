"""Fixed-shape metadata of a decode or verification step, for CUDA-graph capture and replay.

A decode step (every sequence one token) or a verification step (every sequence its last token
and its drafts, ``1 + k_i`` tokens) of at most ``T`` tokens whose contexts are at most
``context`` positions long, and of which at most ``E_k`` complete an entry of compressed kind
``k``, always has index lists of the same shapes: ``T`` token rows, ``E_k`` entry rows,
``sliding_window`` window columns, ``context // ratio`` visible columns per kind. The batch is
laid out per token (each token row its own entry of ``state_slots``, ``cu_seqlens_q`` the
identity), which is all the forward reads of the sequences once the metadata is given: a token
reads the earlier tokens of its sequence in the step from their step rows, as the eager lists
do, whatever the number of tokens per sequence.
:class:`DecodeLayout` fixes those shapes; :meth:`DecodeLayout.fill` writes one step's values
(plain integers in, numpy on the host, no torch op) into one flat int64 host buffer, which one
copy moves into the device buffer a captured graph reads (:meth:`DecodeLayout.metadata` views).

The fields are those :func:`deepinfer.engine.model.metadata.build_metadata` gives (window
lists into ``[ring rows of all slots | the step's rows]``, a token's own position being its
step row), and attention runs the same code on both; the differences change no value attention
reads nor the order it reads them in:

- padding: a step of fewer tokens than the layout's fills the remaining rows with copies of its
  first token (same id, position, state slot, window and visible lists, so they compute what
  that token computes and route to its experts), whose writes go to the reserved scratch state
  slot 0 (window ring, compressor state) instead of the token's own; they complete no entry.
  Entry rows past the step's count repeat its first entry and write it to the null block's
  row 0. Nothing reads slot 0 or block 0, so the real rows' results and the cache outside
  those two are what they would be without padding, as far as each op's result for a row does
  not depend on the row count (always so in batch-invariant mode).
- ``visible`` is padded with ``-1`` to ``context // ratio`` columns (the attention and indexer
  kernels skip ``-1``; trailing ones add exact zeros).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.model.cache import CacheLayout, compressor_state_rows, overlapped
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.metadata import AttentionMetadata, CompressionPlan, ForwardBatch

SCRATCH_SLOT = 0  # the reserved state slot: padding rows write their window and state rows here
NULL_ARENA_ROW = 0  # row 0 of the reserved null block: padding entries are written here


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


def padded_count(count: int, limit: int) -> int:
    """Entry rows of a layout for ``count`` completing tokens: 0, else the next power of two
    (at most ``limit``), so the few counts a step sees share a handful of graphs."""
    if count <= 0:
        return 0
    return min(1 << (count - 1).bit_length(), limit)


def flat_views(fields: dict[str, tuple[int, tuple[int, ...]]], flat) -> dict:
    """``name -> view`` of a flat buffer (numpy array or tensor) laid out as ``fields``
    (``name -> (offset, shape)``)."""
    return {
        name: flat[offset : offset + math.prod(shape)].reshape(shape)
        for name, (offset, shape) in fields.items()
    }


@dataclass
class DecodeLayout:
    """Shapes and flat-buffer offsets of the fixed metadata of ``num_tokens`` token rows
    (decode or verification) with contexts of at most ``context`` positions and ``emits[k]`` (default: all) entry rows
    of kind ``k``; a step may fill fewer of either (the rest is padding, see the module
    docstring), but needs an entry row for each token completing an entry and none to spare
    when no token does."""

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
        self._filled: tuple[np.ndarray, dict] | None = None  # the last buffer and its views
        # per kind, of the last fill: visible columns written, row tables and entry counts
        self._visible_cols: dict[str, int] = {}
        self._visible_of: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if self.ring_size < c.sliding_window:
            raise ValueError(f"ring_size={self.ring_size}: expected at least the sliding "
                             f"window {c.sliding_window}")  # fmt: skip
        if self.emits is None:
            self.emits = (t,) * len(self.kinds)
        w = c.sliding_window
        for name, shape in (("input_ids", (t,)), ("positions", (t,)), ("seq_lens", (t,)),
                            ("state_slots", (t,)), ("write_slots", (t,)), ("rows", (t,)), ("cu_seqlens_q", (t + 1,)),
                            ("window_indices", (t, w)), ("window_write_dst", (t,))):  # fmt: skip
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
        self.size += math.prod(shape)

    def views(self, flat):
        return flat_views(self.fields, flat)

    def fill(self, out: np.ndarray, input_ids, positions, block_tables, state_slots,
             cu_seqlens_q=None, *, refill: bool = False) -> None:  # fmt: skip
        """Write one step into ``out`` (int64 ``[size]``): sequence ``b`` has the tokens
        ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` (None: one token each) of ``input_ids`` at
        consecutive ``positions``, ``block_tables[b]`` (padded rows) and state slot
        ``state_slots[b]``; rows past the step's tokens are padding. ``refill``: ``out`` holds
        this layout's previous fill, nothing else wrote it since (the ``-1`` columns of the
        visible lists that fill left are not written again)."""
        n, v = self.num_tokens, self._views(out)
        p = np.asarray(positions, dtype=np.int64)
        t = len(p)
        if not 0 < t <= n or int(p.max()) + 1 > self.context:
            raise ValueError(f"step of {t} tokens up to position {int(p.max())} "
                             f"does not fit {n} tokens of context {self.context}")  # fmt: skip
        if not refill:
            self._visible_cols, self._visible_of = {}, {}
        cu = np.arange(t + 1) if cu_seqlens_q is None else np.asarray(cu_seqlens_q, np.int64)
        # each row's sequence; padding rows copy row 0, as one-token sequences of sequence 0
        seq = np.zeros(n, dtype=np.int64)
        seq[:t] = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        rows = np.arange(n)
        real = rows < t
        ids = np.asarray(input_ids, dtype=np.int64)
        slots = np.asarray(state_slots, dtype=np.int64)
        s = slots[seq]
        first = np.where(real, cu[seq], rows)  # the step row of its sequence's first token
        start = p[cu[seq]]  # and that token's position
        end = p[cu[seq + 1] - 1] + 1  # seq_lens
        p = np.concatenate([p, np.full(n - t, p[0])])
        # each row's block table and one null column (blocks past a table read the null block)
        tables = np.asarray(block_tables, dtype=np.int64).reshape(len(cu) - 1, -1)
        tables = np.concatenate([tables, np.zeros((len(tables), 1), np.int64)], axis=1)[seq]
        # where each row's writes go: its own slot, the scratch slot for padding rows
        writes = np.where(real, s, SCRATCH_SLOT)
        v["input_ids"][:t] = ids
        v["input_ids"][t:] = ids[0]
        v["positions"][:] = p
        v["seq_lens"][:] = p + 1
        v["state_slots"][:] = s
        v["write_slots"][:] = writes
        v["rows"][:] = rows
        v["cu_seqlens_q"][:] = np.arange(n + 1)
        ring = self.ring_size
        step_base = self.cache_layout.num_slots * ring
        rotations = _rotations(ring, v["window_indices"].shape[1], self.cache_layout.num_slots)
        _window_rows(v["window_indices"], p, s, start, first, ring, step_base, rotations)
        v["window_write_dst"][:] = _kept(writes, p, end, ring) * ring + p % ring
        tokens = _Tokens(p, s, writes, start, first, end, tables, t)
        for k, count in zip(self.kinds, self.emits, strict=True):
            self._fill_kind(v, f"{k.ratio}.{int(k.overlap)}.", k, count, tokens)

    def _views(self, out: np.ndarray) -> dict:
        """``views(out)``, kept for the next fill of the same buffer."""
        if self._filled is None or self._filled[0] is not out:
            self._filled = (out, self.views(out))
        return self._filled[1]

    def _fill_kind(self, v, prefix: str, k: _Kind, count: int, tk: _Tokens) -> None:
        r, p, s, t = k.ratio, tk.positions, tk.slots, tk.num_real
        counts = (p + 1) // r
        emits = np.flatnonzero(counts[:t] * r == p[:t] + 1)  # the tokens completing an entry
        if len(emits) > count or (count and not len(emits)):
            raise ValueError(f"{len(emits)} tokens complete a ratio-{r} entry: this layout "
                             f"has {count} entry rows")  # fmt: skip
        kept = _kept(tk.writes, p, tk.end, k.state_rows)
        v[prefix + "state_write_dst"][:] = kept * k.state_rows + p % k.state_rows
        self._fill_visible(v[prefix + "visible"], prefix, r, counts, tk.tables)
        v[prefix + "visible_count"][:] = counts
        if not count:
            return
        base = self.cache_layout.num_slots * k.state_rows
        se, start, entry = s[emits], tk.start[emits][:, None], counts[emits] - 1
        begin = (entry - 1) * r if k.overlap else entry * r
        q = begin[:, None] + np.arange(2 * r if k.overlap else r)
        # rows of [state | step tokens]: a token of the sequence's step, else its state ring
        src = np.where(q >= start, base + tk.first[emits][:, None] + q - start,
                       se[:, None] * k.state_rows + q % k.state_rows)  # fmt: skip
        src[q < 0] = -1
        lay, n = self.cache_layout, len(emits)  # padding entries: the first, to the null row
        block = np.minimum(entry * r // lay.block_size, tk.tables.shape[1] - 1)
        per_block = lay.block_size // r
        v[prefix + "emit_src"][:n] = src
        v[prefix + "emit_src"][n:] = src[0]
        v[prefix + "emit_positions"][:n] = entry * r
        v[prefix + "emit_positions"][n:] = entry[0] * r
        v[prefix + "emit_rows"][:n] = tk.tables[emits, block] * per_block + entry % per_block
        v[prefix + "emit_rows"][n:] = NULL_ARENA_ROW

    def _fill_visible(self, visible: np.ndarray, prefix: str, r: int, counts, tables) -> None:
        """Each row's arena rows of entries ``0 .. counts - 1``, then ``-1``. Columns past the
        longest count are all -1: only the others are looked up, and those a refill's previous
        fill left at -1 are not written again; nor are the first columns that every row had
        and has, through the same blocks (a decode step adds one entry to a long list)."""
        cols, per_block = int(counts.max()), self.cache_layout.block_size // r
        lo = 0
        if prefix in self._visible_of:
            old_tables, old_counts = self._visible_of[prefix]
            lo = int(np.minimum(old_counts, counts).min())
            blocks = -(-lo // per_block)
            if blocks > min(old_tables.shape[1], tables.shape[1]) - 1 or not np.array_equal(
                old_tables[:, :blocks], tables[:, :blocks]
            ):
                lo = 0
        entries = np.arange(lo, cols)
        # blocks past a table: its null column
        rows = tables[:, np.minimum(entries // per_block, tables.shape[1] - 1)] * per_block
        rows += entries % per_block
        visible[:, lo:cols] = np.where(entries < counts[:, None], rows, -1)
        visible[:, cols : self._visible_cols.get(prefix, visible.shape[1])] = -1
        self._visible_cols[prefix] = cols
        self._visible_of[prefix] = (tables, counts)

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
                visible_count=v[p + "visible_count"],
                # each row its own list: the rows are their own sequences' lists
                seq_rows=v[p + "visible"],
                q_seq=v["rows"],
                visible=v[p + "visible"],
            )
        md = AttentionMetadata(
            num_tokens=self.num_tokens,
            window_base=self.cache_layout.num_slots * self.ring_size,
            window_indices=v["window_indices"],
            window_write_src=v["rows"],
            window_write_dst=v["window_write_dst"],
            plans=plans,
        )
        return batch, md


@dataclass(frozen=True)
class _Tokens:
    """Per token row of a filled step: position, state slot, the slot its writes go to, the
    position and step row of its sequence's first token in the step, its sequence's length
    after the step, its sequence's block table with a null column appended; ``num_real``
    rows are the step's (the rest padding)."""

    positions: np.ndarray
    slots: np.ndarray
    writes: np.ndarray
    start: np.ndarray
    first: np.ndarray
    end: np.ndarray
    tables: np.ndarray
    num_real: int


def _window_rows(out: np.ndarray, positions, slots, start, first, ring: int, step_base: int,
                 rotations: np.ndarray):  # fmt: skip
    """Write ``out[n, w]``: each token's window (positions ``p - w + 1 .. p``) as rows of
    ``[ring rows of all slots | the step's rows]``: from its slot's ring before its sequence's
    first token in the step (at position ``start``, step row ``first``), from the step's rows
    from there on, -1 before position 0 (``rotations``: :func:`_rotations`)."""
    w = out.shape[1]
    oldest, cols = positions - w + 1, np.arange(w)
    np.take(rotations, np.where(oldest >= 0, oldest % ring, ring - 1 - oldest), axis=0, out=out)
    out += (slots * ring)[:, None]
    if oldest.min() < 0:
        np.maximum(out, -1, out=out)
    # the step's own tokens are at most its longest sequence's count of last columns
    last = min(w, int((positions - start).max()) + 1)
    offset = (oldest - start)[:, None] + cols[w - last :]  # q - start
    np.copyto(out[:, w - last :], offset + (step_base + first)[:, None], where=offset >= 0)


@functools.lru_cache(maxsize=16)
def _rotations(ring: int, w: int, num_slots: int) -> np.ndarray:
    """``[ring + w - 1, w]``: row ``o % ring`` holds the ring rows ``(o + j) % ring`` of the
    window ``o .. o + w - 1`` (``o >= 0``); row ``ring - 1 - o`` that of a window starting
    before position 0 (``o < 0``), its columns before 0 far enough below -1 that adding any
    slot's ring base leaves them below -1 (clipped to -1 after)."""
    cols = np.arange(w)
    ahead = (np.arange(ring)[:, None] + cols) % ring
    q = cols - np.arange(1, w)[:, None]  # o = -1, -2, ..., -(w - 1)
    before = np.where(q >= 0, q, -num_slots * ring - 1)
    table = np.concatenate([ahead, before]).astype(np.int64)
    table.flags.writeable = False
    return table


def _kept(writes: np.ndarray, positions: np.ndarray, ends: np.ndarray, ring: int) -> np.ndarray:
    """The slot each row writes its ring row to: the eager step keeps only a sequence's last
    ``ring`` positions (older ones would share a row), the others go to the scratch slot."""
    return np.where(positions >= ends - ring, writes, SCRATCH_SLOT)


def context_bucket(max_seq_len: int, minimum: int) -> int:
    """The smallest power of two >= ``max_seq_len`` and >= ``minimum``."""
    bucket = max(minimum, 1)
    while bucket < max_seq_len:
        bucket *= 2
    return bucket
