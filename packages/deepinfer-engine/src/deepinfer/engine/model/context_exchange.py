"""The border exchange of a context-parallel prefill: each rank computes keys only for the rows
its own queries and the cache need, and receives the rest as finished cache rows.

A rank's *needed* rows are its own rows, the ``border`` rows before each of its runs (the
sliding window and the longest compressor window reach that far back) and the step's last
``tail`` rows (the window ring and the compressor state the step leaves). It gets the attention
inputs of the needed rows other ranks own (:class:`BorderGather`: a few hundred rows a piece,
not the whole prompt) and computes their window KV and compressor projections itself. Each
compressed entry is pooled by the rank owning its last token, and every arena row a rank writes
(entries, index keys) is all-gathered into every rank's arena (:class:`SharedArena`) before
any query reads it. The step's needed rows are described to the metadata builder as one run
per piece (runs of one sequence sharing its block table and state slot); their writes are
trimmed to what the whole step would write: the entries a rank owns, and the ring and state
rows of the last run only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from deepinfer.engine.model.cache import ModelCache, compressor_state_rows, overlapped
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.stack import DecoderStack
from deepinfer.parallel import Communicator


def reach(config, max_draft: int = 0) -> tuple[int, int]:
    """(border: rows before a query or an entry's last token its keys read, tail: the step's
    last rows whose KV and projections the ring and the compressor state keep)."""
    border, tail = config.sliding_window - 1, config.sliding_window + max_draft
    for i, ratio in enumerate(config.compress_ratios[: config.num_layers]):
        if ratio:
            border = max(border, (2 * ratio if overlapped(config, i) else ratio) - 1)
            tail = max(tail, compressor_state_rows(config, i, max_draft))
    return border, tail


def needed_rows(own: torch.Tensor, num_rows: int, border: int, tail: int) -> torch.Tensor:
    """Ascending step rows a rank computes keys for: ``own``, ``border`` rows before each of
    its runs and the last ``tail`` rows."""
    mark = torch.zeros(num_rows, dtype=torch.bool)
    mark[own] = True
    starts = own[torch.cat([torch.tensor([True]), own[1:] != own[:-1] + 1])] if len(own) else own
    for a in starts.tolist():
        mark[max(0, a - border) : a] = True
    mark[max(0, num_rows - tail) :] = True
    return mark.nonzero()[:, 0]


def runs_of(rows: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal ``[start, end)`` runs of consecutive values in ascending ``rows``."""
    cut = (torch.nonzero(rows[1:] != rows[:-1] + 1)[:, 0] + 1).tolist()
    bounds = [0, *cut, len(rows)]
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]


def border_sends(own, needs, owner: torch.Tensor) -> list[torch.Tensor]:
    """Per rank, its own rows that another rank needs (``owner``: each row's rank)."""
    wanted = torch.zeros(len(owner), dtype=torch.bool)
    for rank, need in enumerate(needs):
        wanted[need[owner[need] != rank]] = True
    return [rows[wanted[rows]] for rows in own]


class BorderGather:
    """This rank's attention inputs ``[n_own, ...]`` -> its needed rows' ``[n_need, ...]``: one
    all-gather of the rows any rank needs from another, padded to the longest rank's share."""

    def __init__(self, comm: Communicator, own: Sequence[torch.Tensor], needs, device) -> None:
        num_rows = sum(len(r) for r in own)
        owner = torch.empty(num_rows, dtype=torch.long)
        local = torch.empty(num_rows, dtype=torch.long)
        for rank, rows in enumerate(own):
            owner[rows], local[rows] = rank, torch.arange(len(rows))
        sends = border_sends(own, needs, owner)
        self.width = max(1, max(len(s) for s in sends))
        slot = torch.full((num_rows,), -1, dtype=torch.long)
        for rank, sent in enumerate(sends):
            slot[sent] = rank * self.width + torch.arange(len(sent))
        me, need = comm.rank, needs[comm.rank]
        mine = owner[need] == me
        self.comm = comm
        self.send = local[sends[me]].to(device)
        self.own_dst, self.own_src = mine.nonzero()[:, 0].to(device), local[need[mine]].to(device)
        self.buf_dst, self.buf_src = (
            (~mine).nonzero()[:, 0].to(device),
            slot[need[~mine]].to(device),
        )
        self.num_need = len(need)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros((self.width, *x.shape[1:]))
        padded[: len(self.send)] = x[self.send]
        buf = x.new_empty((self.comm.world_size * self.width, *x.shape[1:]))
        self.comm.all_gather_into_tensor(buf, padded)
        out = x.new_empty((self.num_need, *x.shape[1:]))
        out[self.own_dst] = x[self.own_src]
        out[self.buf_dst] = buf[self.buf_src]
        return out


class SharedArena:
    """The cache as a CP rank uses it: arena rows it writes (compressed entries, index keys)
    are all-gathered into every rank's arena; everything else is the rank's own cache.

    ``block_table``: this rank's blocks of the sequence, in order. Each rank may hold the
    sequence in other blocks (each its own reservation), so rows cross as their place in the
    sequence (index in the table, row in the block) and land in the receiver's blocks."""

    def __init__(
        self, cache: ModelCache, comm: Communicator, width: int, block_table: torch.Tensor
    ) -> None:
        self._cache, self._comm, self._width = cache, comm, max(1, width)
        table = [int(b) for b in block_table.tolist()]
        place = torch.full((cache.layout.num_blocks,), -1, dtype=torch.long)
        for index in reversed(range(len(table))):  # a repeated (padding) id: its first place
            if table[index] >= 0:
                place[table[index]] = index
        device = block_table.device
        self._table, self._place = torch.tensor(table, device=device), place.to(device)

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._cache[key]

    def write(self, key: str, dst: torch.Tensor, values: torch.Tensor) -> None:
        cache, comm, width = self._cache, self._comm, self._width
        cache.write(key, dst, values)
        if not cache.is_arena(key):
            return
        if dst.shape[0] > width:
            raise ValueError(f"{key}: {dst.shape[0]} arena rows written, expected <= {width}")
        t = cache.tensors[key]
        per = t.shape[0] // cache.layout.num_blocks  # arena rows per block
        dst = dst.long()
        ids = torch.full((width,), -1, dtype=torch.long, device=t.device)
        ids[: dst.shape[0]] = self._place[dst // per] * per + dst % per
        rows = t.new_zeros((width, t.shape[1]))
        rows[: dst.shape[0]] = t[dst]
        all_ids = ids.new_empty(comm.world_size * width)
        all_rows = rows.new_empty((comm.world_size * width, t.shape[1]))
        comm.all_gather_into_tensor(all_ids, ids)
        comm.all_gather_into_tensor(all_rows, rows)
        keep = (all_ids >= 0).nonzero()[:, 0]
        here = all_ids[keep]
        t.index_copy_(0, self._table[here // per].long() * per + here % per, all_rows[keep])


def rank_context(
    full: StepContext, rows: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]
) -> StepContext:
    """This rank's context from ``full``, the context of the whole step built with this rank's
    query-side lists (``build_metadata(..., query_rows=rows)``): its per-row tensors taken at
    ``rows``; the key side (window and arena writes, compressor emits and state) stays the
    whole step's, computed from the gathered attention inputs."""
    angles = {k: (cos[rows], sin[rows]) for k, (cos, sin) in full.angles.items()}
    ctx = StepContext(
        full.metadata, full.cache, full.input_ids[rows], full.positions[rows], full.rope, angles
    )
    ctx.tap_layers = full.tap_layers
    for name in ("engram_rows", "token_mask", "image_mask"):
        value = getattr(full, name)
        setattr(ctx, name, None if value is None else value[rows])
    ctx.gather_keys, ctx.key_positions, ctx.key_angles = gather, full.positions, full.angles
    return ctx


def border_context(
    model: nn.Module, cache: ModelCache, batch: ForwardBatch, own: Sequence[torch.Tensor], comm
) -> StepContext:
    """This rank's context for a CP prefill of ``batch`` (one sequence) with the border
    exchange: its own rows' queries over its needed rows' keys."""
    if batch.cu_seqlens_q.numel() != 2:
        raise ValueError("the CP border exchange prefills one sequence per step")
    config, device = model.config, batch.input_ids.device
    num_rows = batch.input_ids.shape[0]
    border, tail = reach(config, cache.layout.max_draft)
    own = [r.long().cpu() for r in own]
    needs = [needed_rows(r, num_rows, border, tail) for r in own]
    need, mine = needs[comm.rank], own[comm.rank]
    runs = runs_of(need)
    start = int(batch.seq_lens[0]) - num_rows
    lengths = torch.tensor([b - a for a, b in runs])
    vbatch = ForwardBatch(
        input_ids=batch.input_ids[need.to(device)],
        positions=batch.positions[need.to(device)],
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device),
        seq_lens=(start + torch.tensor([b for _, b in runs])).to(device),
        block_tables=batch.block_tables.expand(len(runs), -1),
        state_slots=batch.state_slots.expand(len(runs)),
    )
    queries = torch.searchsorted(need, mine)
    md = build_metadata(vbatch, config, cache.layout, cache.ring_size, query_rows=queries)
    md = _trim_writes(md, start, mine, num_rows, len(need) - int(lengths[-1]))
    full = DecoderStack.step_context(model, vbatch, cache, md)
    ctx = rank_context(full, queries.to(device), BorderGather(comm, own, needs, device))
    if config.engram_layer_ids:
        ctx.engram_rows = model.engram_rows(batch, cache)[mine.to(device)]
        ctx.token_mask = torch.ones(len(mine), dtype=torch.bool, device=device)
    # the most arena rows one rank writes per kind: entries of the smallest ratio it completes
    ratio = min((r for r in config.compress_ratios[: config.num_layers] if r), default=1)
    width = max(int(((start + rows + 1) % ratio == 0).sum()) for rows in own)
    ctx.cache = SharedArena(cache, comm, width, batch.block_tables[0])
    return ctx


def _trim_writes(
    md: AttentionMetadata, start: int, mine: torch.Tensor, num_rows: int, last_run: int
) -> AttentionMetadata:
    """Keep the writes the whole step makes once: entries whose last token is this rank's, and
    the window ring and compressor state rows of the last run (the step's tail)."""
    is_mine = torch.zeros(num_rows, dtype=torch.bool)
    is_mine[mine] = True
    plans = {}
    for kind, plan in md.plans.items():
        done = (plan.emit_positions.cpu() + plan.ratio - 1 - start).clamp(0, num_rows - 1)
        emit = is_mine[done].nonzero()[:, 0].to(plan.emit_rows.device)
        state = (plan.state_write_src >= last_run).nonzero()[:, 0]
        plans[kind] = dataclasses.replace(
            plan,
            emit_src=plan.emit_src[emit],
            emit_positions=plan.emit_positions[emit],
            emit_rows=plan.emit_rows[emit],
            state_write_src=plan.state_write_src[state],
            state_write_dst=plan.state_write_dst[state],
        )
    window = (md.window_write_src >= last_run).nonzero()[:, 0]
    return dataclasses.replace(
        md,
        window_write_src=md.window_write_src[window],
        window_write_dst=md.window_write_dst[window],
        plans=plans,
    )
