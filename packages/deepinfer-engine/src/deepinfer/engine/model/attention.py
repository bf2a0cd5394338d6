"""Attention of the V4 family: low-rank q, one shared K=V head, partial interleaved RoPE,
per-head sink, inverse RoPE on the output, grouped output projection; sparse MQA over index
lists built from the sliding window and the compressed entries."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import deepinfer.kernels as K
from deepinfer.engine.model.cache import overlapped
from deepinfer.engine.model.compressor import Compressor
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.indexer import Indexer
from deepinfer.engine.model.indexer_v41 import IndexerV41
from deepinfer.engine.model.layers import LinearFactory, RMSNorm, project
from deepinfer.engine.model.metadata import reads_every_entry
from deepinfer.engine.model.selection import AllVisible, OwnTopK, SharedTopK
from deepinfer.engine.model.variant import variant_of


class QueryHeadNorm(nn.Module):
    """V4's RMSNorm of each query head, without a learned weight."""

    def __init__(self, head_dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        ones = torch.ones(head_dim, dtype=torch.float32, device=device)
        self.register_buffer("unit_weight", ones, persistent=False)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(q, self.unit_weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, factory: LinearFactory) -> None:
        super().__init__()
        c, f = config, factory
        variant = variant_of(c)
        self.config, self.layer_id = c, layer_id
        self.ratio = c.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.groups = c.num_heads, c.head_dim, c.o_groups
        self.rounding = variant.kv_rounding(c)
        self.wq_a = f.quantised(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.wq_b = f.quantised(c.q_lora_rank, c.num_heads * c.head_dim)
        self.wkv = f.quantised(c.hidden_size, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=f.dtype, device=f.device)
        self.wo_a = f.quantised(c.num_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.wo_b = f.quantised(c.o_groups * c.o_lora_rank, c.hidden_size)
        sink = torch.empty(c.num_heads, dtype=torch.float32, device=f.device)
        self.attn_sink = nn.Parameter(sink, requires_grad=False)
        if variant.query_head_norm:
            self.q_head_norm = QueryHeadNorm(c.head_dim, c.rms_norm_eps, f.device)
        else:
            self.q_head_norm = nn.Identity()
        if self.ratio and c.owns_compressor(layer_id):
            self.compressor = Compressor(
                c.head_dim,
                self.ratio,
                overlap=overlapped(c, layer_id),
                with_ape=variant.compressor_ape,
                factory=f,
                eps=c.rms_norm_eps,
            )
        if self.ratio:
            self.selection = self._selection(c, layer_id, f)

    def _selection(self, c: ModelConfig, layer_id: int, f: LinearFactory):
        """This layer's way of picking compressed entries, with the indexer it needs (under
        the checkpoint's name ``indexer``)."""
        if variant_of(c).own_index_compressor:
            if reads_every_entry(c, layer_id):
                return AllVisible()
            self.indexer = Indexer(c, layer_id, f)
            return OwnTopK(self.indexer)
        if c.owns_compressor(layer_id) or c.owns_indexer(layer_id):
            self.indexer = IndexerV41(c, layer_id, f)
        return SharedTopK(c, layer_id, getattr(self, "indexer", None))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x ``[T, D]`` (normed, collapsed streams) -> ``[T, D]``."""
        cos, sin = ctx.angles[self.ratio > 0]
        # the keys come from every row of the step (under context parallelism, gathered)
        keys = ctx.keys_of(x)
        if keys is x:  # wq_a and wkv read one input: quantise it once
            q_latent, kv = project(x, self.wq_a, self.wkv)
        else:
            q_latent, kv = self.wq_a(x), self.wkv(keys)
        qr = self.q_norm(q_latent)
        q = self.q_head_norm(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)))
        # RoPE in place (out=): the rotated tensors are fresh and read nowhere else
        q = K.apply_rope(q, cos, sin, out=q)
        k_cos, k_sin = ctx.angles_of_keys(self.ratio > 0)
        kv = self.kv_norm(kv)
        kv = self.simulate_kv(K.apply_rope(kv, k_cos, k_sin, out=kv))
        sources, indices = self.kv_sources(x, qr, kv, ctx)
        ctx.release_keys()
        o = K.sparse_mqa_sink(q, sources, indices, self.attn_sink, self.head_dim**-0.5)
        md = ctx.metadata
        ctx.cache.write(f"{self.layer_id}.window", md.window_write_dst, kv[md.window_write_src])
        o = o.to(x.dtype)
        o = K.apply_rope(o, cos, sin, inverse=True, out=o)
        grouped = o.reshape(o.shape[0], self.groups, -1)
        z = K.grouped_linear(grouped, self.wo_a.weight, self.wo_a.scale, block_size=self.wo_a.block)
        return self.wo_b(z.flatten(1))

    def kv_sources(self, x, qr, kv, ctx: StepContext) -> tuple[tuple[torch.Tensor, ...], Tensor]:
        """(the KV sources attention reads: window rings, this step's KV, compressed arena;
        index lists ``[T, W + K]`` into their virtual concatenation). The step's KV is written
        to the rings after attention, so eager and graph-replay steps read alike. Cache rows in
        the model's formats are read packed, in place (the op dequantises them), except where
        the metadata has a prefill-sized step read float copies of its rows
        (:class:`~deepinfer.engine.model.metadata.CacheReads`)."""
        md, cache = ctx.metadata, ctx.cache
        window_key = f"{self.layer_id}.window"
        reads = ctx.cache_reads()
        if reads is None:
            window = cache.rows(window_key)[: md.window_base]
            window_indices = md.window_indices
        else:
            window = cache.gather(window_key, reads.ring_rows)
            window_indices = reads.window_indices
        sources = (window, kv.to(cache.dtype))
        if not self.ratio:
            return sources, window_indices
        arena, rows = self.compressed_entries(x, qr, ctx)
        offset = window.shape[0] + kv.shape[0]

        def join() -> Tensor:
            compressed = torch.where(rows >= 0, rows + offset, rows).to(window_indices.dtype)
            return torch.cat([window_indices, compressed], dim=1)

        if not self.selection.same_rows_every_layer:
            return (*sources, arena), join()
        return (*sources, arena), ctx.shared("indices", (window_indices, rows), join, offset)

    def simulate_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Reference window-KV rounding (spec 2.3 step 7 / 7.1; :mod:`.variant`)."""
        return self.rounding.kv(kv)

    def compressed_entries(
        self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update this layer's compressed cache; return (arena ``[M, hd]`` as the step reads
        it, the rows ``[T, K]`` each query reads as indices into it): see
        :meth:`StepContext.arena_rows`."""
        c = self.config
        plan = ctx.metadata.plans[(self.ratio, overlapped(c, self.layer_id))]
        source = c.kv_source_of(self.layer_id)
        if source == self.layer_id and not ctx.entries_written:
            self.write_entries(x, ctx)
        return ctx.arena_rows(f"{source}.kv", plan, self.selection.rows(x, qr, ctx, plan))

    def write_entries(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Compress ``x`` into this kv source's entries completed this step and their index
        keys (a YoCo boundary calls it on every row before truncation drops some)."""
        plan = ctx.metadata.plans[(self.ratio, overlapped(self.config, self.layer_id))]
        key = f"{self.layer_id}.kv"
        latent = self.compressor(ctx.keys_of(x), ctx, plan, f"{self.layer_id}.comp")
        cos_e, sin_e = ctx.entry_angles(plan)
        self.selection.write_keys(latent, cos_e, sin_e, ctx, plan)
        entries = K.apply_rope(latent, cos_e, sin_e, out=latent)  # its index keys are written
        # a packed arena rounds as the model does, from the unrounded rows (FP4 with e4m3
        # scales does not re-pack its own rounded values exactly)
        if key not in ctx.cache.formats:
            entries = self.rounding.entries(entries)
        ctx.cache.write(key, plan.emit_rows, entries)
