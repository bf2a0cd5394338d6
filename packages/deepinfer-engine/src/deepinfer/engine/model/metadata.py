"""Per-step attention metadata: the index lists every attention, compressor and indexer reads.

A forward runs over a flat batch: the tokens of many sequences concatenated (prefill chunks and
decode steps mixed). Sequence ``b`` contributes tokens ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``
at consecutive positions ending at ``seq_lens[b] - 1``. Everything a kernel needs is turned into
row indices here, once per step, on the host (plain integers in, tensors out; no masks), and no
list there grows as query rows times context:

- window lists ``[T, window]``: rows of ``[ring rows of all slots | this step's tokens]``
  (the step's rows are written to the rings after attention reads), formed on the device from
  four numbers a query row (the host builds no ``[T, window]`` list; a prefill-sized step's
  copied ring rows are found per sequence);
- per compression ratio: the source rows of each entry completed this step (in
  ``[compressor state rows | this step's tokens]``), the arena rows they are written to, and each
  query's visible arena rows (entry ``w`` visible at position ``t`` iff ``w < (t + 1) // ratio``)
  as a prefix of its sequence's rows (the indexer ops read them so; the ``[T, C]`` lists of the
  kinds whose layers attend every visible entry are formed on the tensors' device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer.engine.model.cache import CacheLayout, compressor_state_rows, overlapped
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.variant import variant_of
from deepinfer.engine.model.window_lists import (
    named_ring_rows,
    ring_indices,
    state_or_step,
    window_lists,
)


@dataclass(frozen=True)
class ForwardBatch:
    """The flat batch of one step (FlashAttention vocabulary), as plain tensors.

    input_ids ``[T]`` int64; positions ``[T]`` int64; cu_seqlens_q ``[B + 1]``; seq_lens ``[B]``
    (context length after this step); block_tables ``[B, max_blocks]`` arena block ids;
    state_slots ``[B]`` state-slot ids; logits_indices ``[L]`` token rows to compute logits
    for (None: all); prompt_lens ``[B]`` each sequence's known tokens, drafts excluded (its
    prompt while it prefills), which YoCo prefill truncation cuts from (None: ``seq_lens``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor | None = None
    # V4.1 images: the rows of the step's image-span tokens [N] int64 and their embeddings
    # [N, D] (the vision tower's output laid out as spans); None when the step has no image
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    # host copies of the fields the host reads (the index lists' cu_seqlens_q, seq_lens,
    # positions, block_tables, state_slots; YoCo's prompt_lens), when the batch was made from
    # host lists: the lists are then built without reading the device back (no wait for
    # earlier steps)
    host: dict[str, torch.Tensor] | None = None

    def on_host(self, name: str) -> torch.Tensor:
        """Field ``name`` as a host int64 tensor (its host copy when the batch has one; a copy
        whose shape no longer matches the field, left by a ``replace``, is not used)."""
        value = getattr(self, name)
        copy = None if self.host is None else self.host.get(name)
        if copy is not None and copy.shape == value.shape:
            return copy.long()
        return value.cpu().long()


@dataclass(frozen=True)
class CompressionPlan:
    """Index lists of one (ratio, overlap) kind of compressed cache for one step."""

    ratio: int
    state_rows: int
    emit_src: torch.Tensor  # [E, L] rows of [state | step tokens]; -1 = before the sequence
    emit_positions: torch.Tensor  # [E] first position of each entry's window (RoPE position)
    emit_rows: torch.Tensor  # [E] arena rows written
    state_write_src: torch.Tensor  # [n] step-token rows kept as partial-window state
    state_write_dst: torch.Tensor  # [n] state rows they go to
    # each query sees a prefix of its sequence's entries: the first visible_count[t] columns
    # of seq_rows[q_seq[t]] (so the [T, C] lists need not cross from the host)
    visible_count: torch.Tensor  # [T]
    seq_rows: torch.Tensor  # [B, C] arena rows of each sequence's entries, entry order; -1 pad
    q_seq: torch.Tensor  # [T] each query's row of seq_rows
    # [T, C] arena rows visible to each query, entry order, -1 pad, for the kinds whose layers
    # attend every visible entry (None: read through the indexer ops); formed where the plan's
    # tensors live (:func:`visible_rows`)
    visible: torch.Tensor | None = None
    # prefill-sized steps (:class:`CacheReads`): the sorted arena rows of the step's sequences,
    # which its readers copy; None: they read the arena in place
    read_rows: torch.Tensor | None = None

    def all_visible(self) -> torch.Tensor:
        """``[T, C]``: every query's visible arena rows, ``-1`` padded."""
        if self.visible is not None:
            return self.visible
        return visible_rows(self.seq_rows, self.q_seq, self.visible_count)


@dataclass(frozen=True)
class CacheReads:
    """The window-ring rows a prefill-sized step reads, for reading them as one float copy.

    Attention and the indexer read the packed cache in place, decoding rows as they load them;
    mixed sources (packed rings and arena, float step rows) take the kernels' slower load path.
    A step with many query rows and few distinct cache rows (a prefill) instead reads the rows
    it needs as float copies (exact: every packed value is a float of the cache dtype), so every
    source has one format. ``ring_rows`` ``[R]``: the sorted ring rows the window lists name;
    ``window_indices`` ``[T, W]``: the window lists into ``[ring_rows | step rows]``; ``of``:
    the metadata's window lists they translate (a replaced list invalidates them)."""

    ring_rows: torch.Tensor
    window_indices: torch.Tensor
    of: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    window_base: int  # number of ring rows (all slots) before the step-token rows
    window_indices: torch.Tensor  # [T, W]
    window_write_src: torch.Tensor
    window_write_dst: torch.Tensor
    plans: dict[tuple[int, bool], CompressionPlan] = field(default_factory=dict)
    reads: CacheReads | None = None

    def cache_reads(self) -> CacheReads | None:
        """:attr:`reads` if they still translate :attr:`window_indices`."""
        return (
            self.reads if self.reads is not None and self.reads.of is self.window_indices else None
        )


@dataclass(frozen=True)
class _Rows:
    """Per-row sequence facts (a row is a token, or a compressed entry): the first position of
    the sequence's step, its first token row, its state slot and its sequence (its row of the
    sequences' block ``tables``, shared: a copy per row would grow as rows times context)."""

    start: torch.Tensor
    first: torch.Tensor
    slot: torch.Tensor
    seq: torch.Tensor
    tables: torch.Tensor

    def take(self, index: torch.Tensor) -> _Rows:
        return _Rows(
            self.start[index], self.first[index], self.slot[index], self.seq[index], self.tables
        )


def _sequences(batch: ForwardBatch) -> tuple[_Rows, torch.Tensor, torch.Tensor]:
    """Sequence facts (host tensors), the token -> sequence map and the token positions."""
    cu = batch.on_host("cu_seqlens_q")
    lens = batch.on_host("seq_lens")
    counts = cu.diff()
    start = lens - counts
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), counts)
    positions = batch.on_host("positions")
    expected = start[seq_of_token] + torch.arange(len(positions)) - cu[:-1][seq_of_token]
    if (start < 0).any() or not torch.equal(positions, expected):
        bad = int((positions != expected).nonzero()[0, 0]) if len(positions) else 0
        raise ValueError(
            f"token {bad}: position {positions[bad].item()} is not in the consecutive run of "
            f"its sequence ending at seq_lens - 1 (expected {expected[bad].item()})"
        )
    tables = batch.on_host("block_tables")
    seqs = _Rows(start, cu[:-1], batch.on_host("state_slots"), torch.arange(len(lens)), tables)
    return seqs, seq_of_token, positions


def build_metadata(
    batch: ForwardBatch,
    config: ModelConfig,
    layout: CacheLayout,
    ring_size: int,
    query_rows: torch.Tensor | None = None,
    copy_reads: bool = False,
) -> AttentionMetadata:
    """Index lists of one step. Attention reads its KV sources in place (the op indexes the
    rings, the step's rows and the arena without copying them), so the lists have one form
    whatever the batch; the decode graphs' fixed-shape lists only pad them.

    ``query_rows``: the step rows whose queries this process computes (context parallelism:
    the query-side lists, window and visible entries, are built for those rows only; the
    writes stay the whole step's); None: every row. ``copy_reads``: a prefill-sized step also
    gets the lists for reading its cache rows as float copies (:class:`CacheReads`)."""
    seqs, seq_of_token, positions = _sequences(batch)
    device = batch.input_ids.device
    window = config.sliding_window
    base = layout.num_slots * ring_size
    tokens = seqs.take(seq_of_token)
    queries = None if query_rows is None else query_rows.cpu().long()
    q_positions = positions if queries is None else positions[queries]
    q_tokens = tokens if queries is None else tokens.take(queries)
    # the [T, window] lists are formed on the device from 4 numbers a query row
    window_facts = torch.stack([q_positions, q_tokens.start, q_tokens.first, q_tokens.slot])
    keep = positions >= (batch.on_host("seq_lens")[seq_of_token] - ring_size)
    w_src = keep.nonzero()[:, 0]
    w_dst = tokens.slot[w_src] * ring_size + positions[w_src] % ring_size
    kinds = {
        (config.compress_ratios[i], overlapped(config, i)): compressor_state_rows(
            config, i, layout.max_draft
        )
        for i in range(config.num_layers)
        if config.compress_ratios[i] > 0
    }
    every = {
        (config.compress_ratios[i], overlapped(config, i))
        for i in range(config.num_layers)
        if reads_every_entry(config, i)
    }
    # a prefill-sized step copies the cache rows it reads when they are no more than its rows
    num_queries = len(q_positions)
    max_reads = num_queries if copy_reads and num_queries >= COPY_READS_MIN_ROWS else None
    plans = {
        kind: _plan(
            seqs, seq_of_token, positions, batch, kind, state_rows, layout, queries, max_reads
        )  # fmt: skip
        for kind, state_rows in sorted(kinds.items())
    }
    lists = {"window_facts": window_facts, "src": w_src, "dst": w_dst}
    if max_reads is not None:
        ring_rows = named_ring_rows(
            q_positions, q_tokens.seq, seqs.start, seqs.slot, window, ring_size, max_reads
        )
        if ring_rows is not None:
            lists["ring_rows"] = ring_rows
    lists = _to_device(lists, plans, every, device)
    window_rows = window_lists(lists["window_facts"], window, base, ring_size)
    reads = None
    if "ring_rows" in lists:
        ring_rows = lists["ring_rows"]
        reads = CacheReads(ring_rows, ring_indices(window_rows, ring_rows, base), of=window_rows)
    return AttentionMetadata(
        num_tokens=int(batch.input_ids.shape[0] if queries is None else len(queries)),
        window_base=base,
        window_indices=window_rows,
        window_write_src=lists["src"],
        window_write_dst=lists["dst"],
        plans={kind: lists[kind] for kind in plans},
        reads=reads,
    )


# query rows from which a step may read its cache rows as float copies (prefill chunks); a
# step of fewer rows (decode) reads the packed cache in place
COPY_READS_MIN_ROWS = 256


def read_index(read_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Arena rows ``rows`` (``-1``: none) as positions in the sorted ``read_rows`` that hold
    them (on the rows' device: no host work per query row)."""
    return torch.where(rows >= 0, torch.searchsorted(read_rows, rows.clamp(min=0)), -1)


def _arena_rows(rows: _Rows, entries: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """Arena row of entry ``entries[n, c]`` of row n's sequence (entries < 0 -> -1)."""
    per_block = block_size // ratio
    block = (entries.clamp(min=0) * ratio) // block_size
    if block.numel() and int(block.max()) >= rows.tables.shape[1]:
        raise ValueError(
            f"block table too short: entry {int(entries.max())} needs block {int(block.max())}, "
            f"tables have {rows.tables.shape[1]} columns"
        )
    ids = rows.tables[rows.seq[:, None], block]
    if ((ids < 0) & (entries >= 0)).any():
        raise ValueError("block table entry -1 where a compressed entry must be stored")
    return torch.where(entries >= 0, ids * per_block + entries % per_block, -1)


def _plan(
    seqs, seq_of_token, positions, batch, kind, state_rows, layout, queries, max_reads=None
) -> CompressionPlan:
    ratio, overlap = kind
    base = layout.num_slots * state_rows
    width = 2 * ratio if overlap else ratio
    ends = batch.on_host("seq_lens")
    per_seq = [
        torch.arange(a // ratio, b // ratio) for a, b in zip(seqs.start.tolist(), ends.tolist())
    ]
    emitted = torch.cat(per_seq) if per_seq else torch.zeros(0, dtype=torch.long)
    owner = seqs.take(
        torch.repeat_interleave(
            torch.arange(len(per_seq)), torch.tensor([len(e) for e in per_seq], dtype=torch.long)
        )
    )
    first = (emitted - 1) * ratio if overlap else emitted * ratio
    src = state_or_step(first[:, None] + torch.arange(width), owner.start, owner.first,
                        owner.slot, base, state_rows)  # fmt: skip
    tokens = seqs.take(seq_of_token)
    keep = (positions >= ends[seq_of_token] - state_rows).nonzero()[:, 0]
    q_seq = seq_of_token if queries is None else seq_of_token[queries]
    counts = ((positions if queries is None else positions[queries]) + 1) // ratio
    width_c = int(counts.max()) if len(counts) else 0
    # arena rows of entries 0..C-1 once per sequence, then each token keeps its visible prefix
    entries = torch.arange(width_c)
    per_seq_entries = entries[None, :].masked_fill(entries[None, :] >= (ends // ratio)[:, None], -1)
    seq_rows = _arena_rows(seqs, per_seq_entries, ratio, layout.block_size)
    read_rows = None
    if max_reads is not None:  # the sequences' rows, if no more than max_reads
        read_rows = torch.unique(seq_rows[seq_rows >= 0])
        read_rows = read_rows if len(read_rows) <= max_reads else None
    return CompressionPlan(
        ratio=ratio,
        state_rows=state_rows,
        emit_src=src,
        emit_positions=emitted * ratio,
        emit_rows=_arena_rows(owner, emitted[:, None], ratio, layout.block_size)[:, 0],
        state_write_src=keep,
        state_write_dst=tokens.slot[keep] * state_rows + positions[keep] % state_rows,
        visible_count=counts,
        seq_rows=seq_rows,
        q_seq=q_seq,
        read_rows=read_rows,
    )


def visible_rows(seq_rows: torch.Tensor, q_seq: torch.Tensor, counts: torch.Tensor):
    """``[T, C]``: each query's first ``counts[t]`` entries of its sequence's ``seq_rows``
    ``[B, C]``, ``-1`` after them (on the tensors' device)."""
    cols = torch.arange(seq_rows.shape[1], device=seq_rows.device)
    return torch.where(cols < counts[:, None], seq_rows[q_seq], -1)


def reads_every_entry(config: ModelConfig, layer_id: int) -> bool:
    """Whether compressed layer ``layer_id`` attends every visible entry (V4's heavily
    compressed layers) rather than an indexer's picks."""
    return (
        config.compress_ratios[layer_id] > 0
        and variant_of(config).own_index_compressor
        and config.index_source_of(layer_id) is None
    )


def _to_device(lists: dict, plans: dict, every: set, device: torch.device) -> dict:
    """The step's host index lists and ``plans`` on ``device`` through one transfer per dtype
    (they are all int64), not one per list: views of one device buffer. The plans of the kinds
    in ``every`` (whose layers attend every visible entry) get their ``[T, C]`` lists, formed
    there."""
    for kind, plan in plans.items():
        lists = lists | {(kind, name): t for name, t in _plan_tensors(plan).items()}
    if device.type != "cpu":
        moved = {}
        for dtype in {t.dtype for t in lists.values()}:
            same = {k: t for k, t in lists.items() if t.dtype == dtype}
            flat = torch.cat([t.reshape(-1) for t in same.values()]).to(device, non_blocking=True)
            parts = flat.split([t.numel() for t in same.values()])
            moved |= {k: part.view(t.shape) for (k, t), part in zip(same.items(), parts)}
        lists = {k: moved[k] for k in lists}
    for kind, plan in plans.items():
        moved_plan = dataclasses.replace(
            plan, **{name: lists[(kind, name)] for name in _plan_tensors(plan)}
        )
        if kind in every:
            moved_plan = dataclasses.replace(moved_plan, visible=moved_plan.all_visible())
        lists[kind] = moved_plan
    return lists


def _plan_tensors(plan: CompressionPlan) -> dict[str, torch.Tensor]:
    return {
        name: getattr(plan, name)
        for name in plan.__dataclass_fields__
        if isinstance(getattr(plan, name), torch.Tensor)
    }
