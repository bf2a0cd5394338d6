"""SWA bounded replay: YoCo prefill truncation of V4.1's consumer layers (spec 4.5).

From the first ratio-1 layer (the *boundary*) on, every compressed layer reads the compressed
KV and index keys the boundary derives from its own attention input, so decode needs a
consumer layer's per-token state of old positions only through that layer's sliding window.
With truncation on, a prompt's consumer queries see window keys only at positions
``>= prompt_len - keep_tokens`` (the *cut*; compressed attention still covers the whole
prompt), which is an approximation of the model, off by default. Modes:

- ``mask``: every row runs; only the consumer layers' windows are narrowed to the cut;
- ``compact``: the boundary still compresses every row of the chunk into the shared entries,
  then only the rows at or after the cut (at least the chunk's last row) run through the
  consumer layers, the MoE, the DSpark taps and the head. Rows before the cut feed nothing
  a kept row reads, so ``compact`` equals ``mask`` bit for bit where rows are batch invariant.

``keep_tokens >= sliding_window + max_draft`` keeps a full window for every decode query, a
rollback of rejected drafts included, so decode never reads a row that truncation skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import deepinfer.kernels as K
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.window_lists import window_positions

MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class PrefillTruncation:
    """An enabled truncation: ``mode`` mask | compact; consumer layers from ``boundary``."""

    mode: str
    keep_tokens: int
    boundary: int


def consumer_boundary(config: ModelConfig) -> int | None:
    """The first consumer layer: V4.1's first ratio-1 layer when it is a kv source and every
    compressed layer from it on reads its entries; None when the model has no consumers."""
    if not config.is_v41 or 1 not in config.compress_ratios:
        return None
    boundary = config.compress_ratios.index(1)
    for layer in range(boundary, config.num_layers):
        if config.compress_ratios[layer] and config.kv_source_of(layer) != boundary:
            return None
    return boundary


def prefill_truncation(
    config: ModelConfig, mode: str, keep_tokens: int, max_draft: int
) -> PrefillTruncation | None:
    """The checked setting (None for ``off``; ``keep_tokens`` 0: the least allowed,
    ``sliding_window + max_draft``); a bad one raises one line naming the field."""
    name = "yoco_prefill_truncation_mode"
    if mode not in MODES:
        raise ValueError(f"{name}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return None
    boundary = consumer_boundary(config)
    if boundary is None:
        raise ValueError(
            f"{name}={mode!r}: this model has no YoCo consumer layers (V4.1 layers that share the "
            "first ratio-1 layer's compressed KV); use 'off'"
        )
    need = config.sliding_window + max_draft
    keep_tokens = keep_tokens or need
    if keep_tokens < need:
        raise ValueError(
            f"yoco_prefill_keep_tokens={keep_tokens}: expected >= sliding_window + max "
            f"speculative backtracking = {config.sliding_window} + {max_draft} = {need}"
        )
    if boundary in config.engram_layer_ids:
        raise ValueError(
            f"{name}={mode!r}: Engram at the boundary layer {boundary} would straddle the "
            "truncation; expected Engram layers before or after it"
        )
    return PrefillTruncation(mode, keep_tokens, boundary)


@dataclass(frozen=True)
class KeptRows:
    """Host facts of one step: ``cut [B]`` each sequence's first visible window position,
    ``token_cut [T]`` per token, ``rows [N]`` the batch rows the consumer layers compute
    (ascending), ``counts [B]`` kept rows per sequence."""

    cut: torch.Tensor
    token_cut: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor

    @property
    def drops_rows(self) -> bool:
        return int(self.counts.sum()) < len(self.token_cut)


def kept_rows(batch: ForwardBatch, keep_tokens: int) -> KeptRows:
    """Rows at or after each sequence's cut ``prompt_len - keep_tokens`` (``prompt_lens``,
    else the step's ``seq_lens``), and at least each chunk's last row."""
    cu = batch.on_host("cu_seqlens_q")
    ends = batch.on_host("seq_lens")
    known = ends if batch.prompt_lens is None else batch.on_host("prompt_lens")
    counts = cu.diff()
    start = ends - counts
    cut = (known - keep_tokens).clamp(min=0)
    first = torch.minimum(torch.maximum(cut, start), ends - 1)
    kept = ends - first
    rows = [torch.arange(int(b - k), int(b)) for b, k in zip(cu[1:], kept)]
    rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return KeptRows(cut, cut.repeat_interleave(counts), rows, kept)


def consumer_rows(batch: ForwardBatch, truncation: PrefillTruncation | None) -> int:
    """Rows each consumer layer computes for ``batch`` (the FLOPs estimate's row count)."""
    if truncation is None or truncation.mode != "compact":
        return int(batch.input_ids.shape[0])
    return int(kept_rows(batch, truncation.keep_tokens).counts.sum())


def narrow_window(
    md: AttentionMetadata, positions: torch.Tensor, token_cut: torch.Tensor, window: int
) -> AttentionMetadata:
    """``md`` with every query's window keys before its sequence's cut hidden (-1)."""
    q = window_positions(positions.cpu().long(), window)
    hidden = (q < token_cut[:, None]).to(md.window_indices.device)
    return dataclasses.replace(md, window_indices=md.window_indices.masked_fill(hidden, -1))


def compact_batch(batch: ForwardBatch, kept: KeptRows) -> ForwardBatch:
    """The kept rows as a batch of their own: each sequence's kept rows are the consecutive
    run ending at ``seq_lens - 1``, so the usual metadata applies to it."""
    rows = kept.rows.to(batch.input_ids.device)
    cu = torch.zeros(len(kept.counts) + 1, dtype=batch.cu_seqlens_q.dtype)
    cu[1:] = kept.counts.cumsum(0)
    host = None
    if batch.host is not None:  # the kept rows' host copies (the index lists read them)
        host = batch.host | {"positions": batch.on_host("positions")[kept.rows],
                             "cu_seqlens_q": cu}  # fmt: skip
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        cu_seqlens_q=cu.to(batch.cu_seqlens_q.device),
        logits_indices=_compact_logits_rows(batch, kept),
        host=host,
    )


def _compact_logits_rows(batch: ForwardBatch, kept: KeptRows) -> torch.Tensor | None:
    """``batch.logits_indices`` renumbered into the kept rows (each must be kept)."""
    if batch.logits_indices is None:
        return None  # every computed row
    wanted = batch.logits_indices.cpu().long()
    where = torch.searchsorted(kept.rows, wanted).clamp(max=len(kept.rows) - 1)
    found = kept.rows[where] == wanted
    if not bool(found.all()):
        row = int(wanted[~found][0])
        raise ValueError(
            f"logits wanted at batch row {row}, which YoCo compact truncation drops "
            "(prompt logprobs cannot be computed under truncation)"
        )
    return where.to(batch.logits_indices.device)


def compact_context(
    ctx: StepContext, batch: ForwardBatch, kept: KeptRows, cache: ModelCache, config: ModelConfig
) -> tuple[StepContext, ForwardBatch]:
    """The consumer layers' context over the kept rows: their own metadata (window narrowed,
    entries already written by the boundary), every per-row tensor gathered."""
    small = compact_batch(batch, kept)
    md = build_metadata(small, config, cache.layout, cache.ring_size)
    md = narrow_window(md, small.positions, kept.token_cut[kept.rows], config.sliding_window)
    rows = kept.rows.to(batch.input_ids.device)
    angles = {k: (cos[rows], sin[rows]) for k, (cos, sin) in ctx.angles.items()}
    out = StepContext(md, cache, small.input_ids, small.positions, ctx.rope, angles)
    out.tap_layers = ctx.tap_layers
    out.taps = {layer: t[rows] for layer, t in ctx.taps.items()}
    out.selected = {ratio: s[rows] for ratio, s in ctx.selected.items()}
    for name in ("candidate_mask", "engram_rows", "token_mask", "image_mask"):
        value = getattr(ctx, name)
        setattr(out, name, None if value is None else value[rows])
    out.entries_written = True
    return out, small


def run_consumers(model, streams, pre, ctx: StepContext, batch: ForwardBatch, cache):
    """Run the consumer layers of ``model`` after its producers: (streams, pre, context the
    consumers ran with, the batch rows they computed or None for all, the batch they saw)."""
    t: PrefillTruncation = model.truncation
    config = model.config
    kept = kept_rows(batch, t.keep_tokens)
    consumers = model.layers[t.boundary :]
    if t.mode == "compact" and kept.drops_rows:
        block = consumers[0]
        x = block.attn_norm(K.hc_collapse(streams, pre))
        block.attn.write_entries(x, ctx)  # every row's shared entries, before any row is dropped
        ctx, batch = compact_context(ctx, batch, kept, cache, config)
        rows = kept.rows.to(streams.device)
        streams, pre = streams[rows], pre[rows]
    else:
        rows = None
        ctx.metadata = narrow_window(
            ctx.metadata, batch.positions, kept.token_cut, config.sliding_window
        )
    for block in consumers:
        streams, pre = block.forward_v41(streams, pre, ctx)
    return streams, pre, ctx, rows, batch
