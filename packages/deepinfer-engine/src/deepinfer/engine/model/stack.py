"""The decoder stack V4 and V4.1 share: ``embed`` -> ``hc_mult`` streams -> ``layers`` ->
final collapse -> ``norm`` -> ``head`` (fp32 logits). Each variant picks how the streams are
threaded through the blocks (:mod:`.hc`) and adds its own pieces (:mod:`.model_v4`,
:mod:`.model_v41`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.block import Block
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import Embedding, LinearFactory, RMSNorm
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.mtp import build_draft_stages
from deepinfer.engine.model.rope import RopeTables
from deepinfer.engine.model.variant import variant_of
from deepinfer.parallel import ExpertParallelContext


@dataclass(frozen=True)
class StepOutput:
    """What a forward returns besides logits, for the draft stages.

    logits ``[L, vocab]`` fp32 (rows ``logits_indices``); taps ``[T, n_taps * D]`` fp32 (the
    DSpark taps in ``dspark_target_layer_ids`` order, None without them); streams ``[T, nc, D]``
    the final streams before the head collapse; pre ``[T, nc]`` V4.1's final collapse weights;
    rows ``[N]``: the batch rows taps, streams and pre belong to when YoCo compact truncation
    computed only those (then ``T = N``; None: every row).
    """

    logits: torch.Tensor
    taps: torch.Tensor | None
    streams: torch.Tensor
    pre: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def collect_taps(ctx: StepContext) -> torch.Tensor | None:
    if not ctx.tap_layers:
        return None
    return torch.cat([ctx.taps[i] for i in ctx.tap_layers], dim=-1)


class DecoderStack(nn.Module):
    """The shared stack; ``include_mtp`` adds the checkpoint's draft stages as ``mtp``;
    ``expert_parallel`` makes the backbone's MoE layers expert parallel (the draft stages keep
    every expert)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        include_mtp: bool = False,
        expert_parallel: ExpertParallelContext | None = None,
    ):
        super().__init__()
        c = self.config = config
        factory = LinearFactory(config, dtype, device)
        self.mix = variant_of(config).mix
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Block(c, i, factory, expert_parallel) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.head = factory.dense(c.hidden_size, c.vocab_size)
        self.mix.attach_head(self, c, device)
        self.build_variant(factory, device)
        self.rope = RopeTables(c, "cpu" if device in (None, "meta") else device)
        stages = build_draft_stages(c, factory) if include_mtp else None
        if stages is not None:
            self.mtp = stages

    def build_variant(self, factory: LinearFactory, device) -> None:
        """The variant's own modules and state, built after the shared ones."""

    def step_context(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepContext:
        """``metadata``: index lists built elsewhere (fixed-shape decode metadata, or a
        fixed-shape training batch's); None builds them from ``batch``."""
        md = metadata or build_metadata(
            batch, self.config, cache.layout, cache.ring_size, copy_reads=True
        )
        angles = {
            compressed: RopeTables.angles(self.rope.table(compressed), batch.positions)
            for compressed in (False, True)
        }
        ctx = StepContext(md, cache, batch.input_ids, batch.positions, self.rope, angles)
        ctx.tap_layers = self.config.dspark_target_layer_ids
        return ctx

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """The input rows ``[T, D]``: token embeddings (V4.1 puts image spans' rows in)."""
        return self.embed(batch.input_ids)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Logits ``[L, vocab]`` fp32 for ``batch.logits_indices`` (all tokens if None)."""
        return self.forward_step(batch, cache).logits

    def forward_step(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepOutput:
        ctx = self.step_context(batch, cache, metadata)
        h = self.embed_tokens(batch)
        streams = h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        streams, pre = self.mix.run(self.layers, streams, ctx)
        logits = self.logits(streams, pre, batch.logits_indices)
        return StepOutput(logits, collect_taps(ctx), streams, pre)

    def logits(
        self, streams: torch.Tensor, pre: torch.Tensor | None, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 logits ``[L, vocab]`` of the final ``streams`` (rows ``rows``; None: all)."""
        if rows is not None:
            streams, pre = streams[rows], (None if pre is None else pre[rows])
        y = self.norm(self.mix.collapse(self, streams, pre))
        return K.linear(y.float(), self.head.weight, out_dtype=torch.float32)
