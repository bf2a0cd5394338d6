"""How a compressed attention layer picks the entries each query reads: arena rows per query
``[T, K]`` (``-1`` = none), one strategy per layer, chosen when the layer is built."""

from __future__ import annotations

import functools

import torch

from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.indexer import Indexer
from deepinfer.engine.model.indexer_v41 import IndexerV41
from deepinfer.engine.model.metadata import CompressionPlan


class AllVisible:
    """Every visible entry (V4's heavily compressed layers): the plan's rows, the same in every
    layer of the kind."""

    same_rows_every_layer = True

    def write_keys(self, latent, cos, sin, ctx: StepContext, plan: CompressionPlan) -> None:
        """No index keys to keep."""

    def rows(self, x, qr, ctx: StepContext, plan: CompressionPlan) -> torch.Tensor:
        return plan.all_visible()


class OwnTopK:
    """V4 CSA: the layer's own indexer compresses its keys from ``x`` as it scores, and keeps
    each query's top k."""

    same_rows_every_layer = False

    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer

    def write_keys(self, latent, cos, sin, ctx: StepContext, plan: CompressionPlan) -> None:
        """The indexer writes its own keys in :meth:`rows`."""

    def rows(self, x, qr, ctx: StepContext, plan: CompressionPlan) -> torch.Tensor:
        return self.indexer(x, qr, ctx, plan)


class SharedTopK:
    """V4.1 CSA2: a kv source writes the index keys of its group from its compressor's latent;
    an index source scores them and keeps each query's top k (``ctx.selected``), which the
    layers after it of the same ratio reuse."""

    same_rows_every_layer = False  # an index source's picks, fresh each time it scores

    def __init__(self, config: ModelConfig, layer_id: int, indexer: IndexerV41 | None) -> None:
        self.indexer, self.layer_id = indexer, layer_id
        self.ratio = config.compress_ratios[layer_id]
        self.kv_source = config.kv_source_of(layer_id)
        self.scores = config.owns_indexer(layer_id)

    def write_keys(self, latent, cos, sin, ctx: StepContext, plan: CompressionPlan) -> None:
        store = functools.partial(ctx.cache.write, f"{self.layer_id}.index_keys")
        self.indexer.write_keys(latent, cos, sin, store, plan)

    def rows(self, x, qr, ctx: StepContext, plan: CompressionPlan) -> torch.Tensor:
        if self.scores:
            keys = f"{self.kv_source}.index_keys"
            ctx.selected[self.ratio] = self.indexer(x, qr, ctx, plan, keys)
        return ctx.selected[self.ratio]
