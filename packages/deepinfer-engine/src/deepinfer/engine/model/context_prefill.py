"""Context-parallel prefill: the ranks of a context-parallel (CP) group prefill one step's rows
together, each computing the queries and token-local work of its own rows only.

Each rank owns the rows :func:`deepinfer.parallel.context.balanced_split` deals it. Embeddings,
mHC, Engram, MoE, norms and the head run on its rows alone; attention and indexer queries too.
At every attention layer a rank gets the keys its queries read in one of two ways:

- ``"borders"`` (:mod:`.context_exchange`, the default): the attention inputs of the rows just
  before its pieces (the window and the longest compressor window) and of the step's tail, from
  their owners; each rank pools the compressed entries whose last token it owns and all ranks
  all-gather the finished entries and index keys.
- ``"hidden"``: every row's attention inputs, all-gathered and put back in step order
  (:class:`RowGather`), so each rank computes the whole step's keys itself (simple; moves
  ``hidden_size`` values a row per layer and repeats the key projections on every rank).

Either way every rank ends with the whole step in its cache (whichever rank decodes needs no
transfer), and the logits of all rows can be gathered like any layer input
(:class:`RowGather`). Engram lookups hash token ids, which every rank has: the whole step's
table rows are computed everywhere and each rank keeps its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context_exchange import border_context, rank_context
from deepinfer.engine.model.metadata import ForwardBatch, build_metadata
from deepinfer.parallel import Communicator
from deepinfer.parallel.context import AttentionShape, balanced_split


def attention_shape(config: ModelConfig) -> AttentionShape:
    """The per-query attention cost model of ``config`` the balanced split deals work by (V4.1
    selects top-k in every compressed layer; the model counts ratio-1 layers as all-visible,
    which only shifts the balance, never the result)."""
    return AttentionShape(
        window=config.sliding_window,
        compress_ratios=tuple(config.compress_ratios[: config.num_layers]),
        index_topk=config.index_topk,
        heads=config.num_heads,
        head_dim=config.head_dim,
        index_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        csa_ratio=2 if config.is_v41 else 4,
    )


@dataclass(frozen=True)
class RowSplit:
    """Which step rows each CP rank computes: ``rows[r]`` ascending int64, together every row
    ``0 .. num_rows - 1`` exactly once."""

    rows: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("RowSplit.rows: expected one row list per CP rank, got none")
        every = torch.cat([r.long() for r in self.rows])
        if not torch.equal(every.sort().values, torch.arange(len(every))):
            raise ValueError(
                f"RowSplit.rows: expected a partition of rows 0..{len(every) - 1} over the ranks"
            )

    @classmethod
    def balanced(cls, num_rows: int, cp: int, config: ModelConfig, rounds: int = 8) -> RowSplit:
        """The load-balanced split of a prompt's ``num_rows`` positions from 0 (``rounds``:
        pieces per rank / 2, :func:`~deepinfer.parallel.context.balanced_split`)."""
        return cls(tuple(balanced_split(num_rows, cp, attention_shape(config), rounds)))

    @property
    def cp(self) -> int:
        return len(self.rows)

    @property
    def num_rows(self) -> int:
        return sum(len(r) for r in self.rows)


class RowGather:
    """All-gathers each rank's rows ``[n_r, ...]`` into the whole step's ``[N, ...]`` in step
    order (padded to the longest rank's count, so one ``all_gather_into_tensor`` suffices)."""

    def __init__(self, comm: Communicator, split: RowSplit, device: torch.device | str) -> None:
        if comm.world_size != split.cp:
            raise ValueError(
                f"context_parallel_size={split.cp}: the communicator has {comm.world_size} ranks"
            )
        self.comm, self.split = comm, split
        self.width = max(len(r) for r in split.rows)
        source = torch.empty(split.num_rows, dtype=torch.long)
        for rank, rows in enumerate(split.rows):
            source[rows.long()] = rank * self.width + torch.arange(len(rows))
        self.source = source.to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        own = len(self.split.rows[self.comm.rank])
        if x.shape[0] != own:
            raise ValueError(f"rows to gather: expected this rank's {own}, got {x.shape[0]}")
        padded = x.new_zeros((self.width, *x.shape[1:]))
        padded[:own] = x
        out = x.new_empty((self.split.cp * self.width, *x.shape[1:]))
        self.comm.all_gather_into_tensor(out, padded)
        return out.index_select(0, self.source)


@torch.no_grad()
def context_parallel_prefill(
    model: nn.Module,
    cache: ModelCache,
    batch: ForwardBatch,
    split: RowSplit,
    comm: Communicator,
    exchange: str = "borders",
) -> torch.Tensor:
    """fp32 logits ``[L, vocab]`` of this rank's rows ``split.rows[comm.rank]`` of ``batch``
    that ``batch.logits_indices`` asks for (None: all of them), in row order; every rank of
    ``comm`` calls it with the same ``batch`` and ``split``, and afterwards each one's
    ``cache`` holds the whole step. Text rows only; YoCo truncation is not applied.

    ``exchange``: ``"borders"`` (one sequence per step; :mod:`.context_exchange`: each rank
    receives the attention inputs of the rows before its pieces and every rank's finished
    entries) or ``"hidden"`` (every layer's attention inputs of every row, any batch)."""
    if split.num_rows != batch.input_ids.shape[0]:
        raise ValueError(
            f"RowSplit covers {split.num_rows} rows: expected the batch's "
            f"{batch.input_ids.shape[0]}"
        )
    empty = [rank for rank, rows in enumerate(split.rows) if len(rows) == 0]
    if empty:
        raise ValueError(
            f"RowSplit: rank {empty[0]} has no rows of the {split.num_rows}-row step; "
            "prefill a step this short on one rank"
        )
    if batch.image_rows is not None:
        raise ValueError("context_parallel_prefill: image inputs are not supported (text only)")
    device = batch.input_ids.device
    rows = split.rows[comm.rank].long().to(device)
    if exchange == "borders":
        ctx = border_context(model, cache, batch, split.rows, comm)
    elif exchange == "hidden":
        md = build_metadata(batch, model.config, cache.layout, cache.ring_size, query_rows=rows)
        full = model.step_context(batch, cache, md)
        ctx = rank_context(full, rows, RowGather(comm, split, device))
    else:
        raise ValueError(f"exchange={exchange!r}: expected 'borders' or 'hidden'")
    h = model.embed(ctx.input_ids)
    streams = h.unsqueeze(1).repeat(1, model.config.hc_mult, 1)
    streams, pre = model.mix.run(model.layers, streams, ctx)
    wanted = None
    if batch.logits_indices is not None:
        wanted = torch.isin(rows, batch.logits_indices.to(device).long()).nonzero()[:, 0]
    return model.logits(streams, pre, wanted)


def prompt_logprobs(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 ``[N - 1]``: the log-probability of each prompt token after the first, from the
    whole prompt's logits ``[N, vocab]``."""
    target = torch.as_tensor(list(tokens[1:]), dtype=torch.long, device=logits.device)
    rows = torch.log_softmax(logits[:-1].float(), dim=-1)
    return rows.gather(1, target[:, None])[:, 0]
