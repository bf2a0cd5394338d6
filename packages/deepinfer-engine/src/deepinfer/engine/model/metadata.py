"""Per-step attention metadata: the index lists every attention, compressor and indexer reads.

A forward runs over a flat batch: the tokens of many sequences concatenated (prefill chunks and
decode steps mixed). Sequence ``b`` contributes tokens ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``
at consecutive positions ending at ``seq_lens[b] - 1``. Everything a kernel needs is turned into
row indices here, once per step, on the host (plain integers in, tensors out; no masks):

- window lists ``[T, window]``: rows of ``[ring rows of all slots | this step's tokens]``;
- per compression ratio: the source rows of each entry completed this step (in
  ``[compressor state rows | this step's tokens]``), the arena rows they are written to, and each
  query's visible arena rows (entry ``w`` visible at position ``t`` iff ``w < (t + 1) // ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.model.cache import CacheLayout, compressor_state_rows, overlapped
from deepinfer.engine.model.config import ModelConfig


@dataclass(frozen=True)
class ForwardBatch:
    """The flat batch of one step (FlashAttention vocabulary), as plain tensors.

    input_ids ``[T]`` int64; positions ``[T]`` int64; cu_seqlens_q ``[B + 1]``; seq_lens ``[B]``
    (context length after this step); block_tables ``[B, max_blocks]`` arena block ids;
    state_slots ``[B]`` state-slot ids; logits_indices ``[L]`` token rows to compute logits
    for (None: all).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor | None = None


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
    visible: torch.Tensor  # [T, C] arena rows visible to each query, entry order; -1 pad
    visible_count: torch.Tensor  # [T]


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    window_base: int  # number of ring rows (all slots) before the step-token rows
    window_indices: torch.Tensor  # [T, W]
    window_write_src: torch.Tensor
    window_write_dst: torch.Tensor
    plans: dict[tuple[int, bool], CompressionPlan] = field(default_factory=dict)


@dataclass(frozen=True)
class _Seq:
    first_token: int
    start: int  # position of the first token of this step
    end: int  # seq_len: one past the last position
    slot: int
    blocks: list[int]


def _sequences(batch: ForwardBatch) -> list[_Seq]:
    cu = batch.cu_seqlens_q.tolist()
    lens = batch.seq_lens.tolist()
    slots = batch.state_slots.tolist()
    tables = batch.block_tables.tolist()
    positions = batch.positions.tolist()
    seqs = []
    for b in range(len(lens)):
        n = cu[b + 1] - cu[b]
        start = lens[b] - n
        if start < 0 or positions[cu[b] : cu[b + 1]] != list(range(start, lens[b])):
            raise ValueError(
                f"sequence {b}: positions {positions[cu[b] : cu[b + 1]]} are not the "
                f"consecutive run ending at seq_lens[{b}] - 1 = {lens[b] - 1}"
            )
        seqs.append(_Seq(cu[b], start, lens[b], slots[b], tables[b]))
    return seqs


def build_metadata(
    batch: ForwardBatch, config: ModelConfig, layout: CacheLayout, ring_size: int
) -> AttentionMetadata:
    seqs = _sequences(batch)
    device = batch.input_ids.device
    window = config.sliding_window
    base = layout.num_slots * ring_size
    rows, w_src, w_dst = [], [], []
    for s in seqs:
        for p in range(s.start, s.end):
            rows.append(
                [_step_or_state(q, s, base, ring_size) for q in range(p - window + 1, p + 1)]
            )
        for p in range(max(s.start, s.end - ring_size), s.end):
            w_src.append(s.first_token + p - s.start)
            w_dst.append(s.slot * ring_size + p % ring_size)
    kinds = {
        (config.compress_ratios[i], overlapped(config, i))
        for i in range(config.num_layers)
        if config.compress_ratios[i] > 0
    }
    plans = {}
    for ratio, overlap in sorted(kinds):
        layer = next(
            i
            for i in range(config.num_layers)
            if (config.compress_ratios[i], overlapped(config, i)) == (ratio, overlap)
        )
        state_rows = compressor_state_rows(config, layer)
        plans[(ratio, overlap)] = _plan(seqs, ratio, overlap, state_rows, layout, device)
    return AttentionMetadata(
        num_tokens=int(batch.input_ids.shape[0]),
        window_base=base,
        window_indices=_tensor(rows, device, width=window),
        window_write_src=torch.tensor(w_src, dtype=torch.long, device=device),
        window_write_dst=torch.tensor(w_dst, dtype=torch.long, device=device),
        plans=plans,
    )


def _step_or_state(q: int, s: _Seq, base: int, rows: int) -> int:
    """Row of position ``q`` in ``[state rows of all slots | step tokens]`` (-1: before 0)."""
    if q < 0:
        return -1
    if q >= s.start:
        return base + s.first_token + q - s.start
    return s.slot * rows + q % rows


def _arena_row(s: _Seq, w: int, ratio: int, block_size: int) -> int:
    per_block = block_size // ratio
    block = (w * ratio) // block_size
    if block >= len(s.blocks) or s.blocks[block] < 0:
        raise ValueError(f"block table too short: entry {w} needs block {block}, table {s.blocks}")
    return s.blocks[block] * per_block + w % per_block


def _plan(seqs, ratio, overlap, state_rows, layout, device) -> CompressionPlan:
    base = layout.num_slots * state_rows
    width = 2 * ratio if overlap else ratio
    src, positions, dst, keep_src, keep_dst, visible, counts = [], [], [], [], [], [], []
    for s in seqs:
        for w in range(s.start // ratio, s.end // ratio):
            first = (w - 1) * ratio if overlap else w * ratio
            src.append(
                [_step_or_state(q, s, base, state_rows) for q in range(first, first + width)]
            )
            positions.append(w * ratio)
            dst.append(_arena_row(s, w, ratio, layout.block_size))
        for p in range(max(s.start, s.end - state_rows), s.end):
            keep_src.append(s.first_token + p - s.start)
            keep_dst.append(s.slot * state_rows + p % state_rows)
        for p in range(s.start, s.end):
            n = (p + 1) // ratio
            visible.append([_arena_row(s, w, ratio, layout.block_size) for w in range(n)])
            counts.append(n)
    long = dict(dtype=torch.long, device=device)
    return CompressionPlan(
        ratio=ratio,
        state_rows=state_rows,
        emit_src=_tensor(src, device, width=width),
        emit_positions=torch.tensor(positions, **long),
        emit_rows=torch.tensor(dst, **long),
        state_write_src=torch.tensor(keep_src, **long),
        state_write_dst=torch.tensor(keep_dst, **long),
        visible=_tensor(visible, device, width=max(counts, default=0)),
        visible_count=torch.tensor(counts, **long),
    )


def _tensor(rows: list[list[int]], device: torch.device, width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, values in enumerate(rows):
        if values:
            out[r, : len(values)] = torch.tensor(values, dtype=torch.long)
    return out.to(device)
