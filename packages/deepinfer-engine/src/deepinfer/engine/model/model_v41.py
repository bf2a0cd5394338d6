"""The V4.1 stack: deferred mHC pre-mix (no ``hc_head``), CSA2 shared compressed KV, Engram.

``embed`` -> ``hc_mult`` streams -> ``layers`` (each: Engram at its layers, attention and MoE
with the previous site's ``pre``; layer 0's attention collapses stream 0) -> collapse with the
last FFN site's ``pre`` -> ``norm`` -> ``head`` (fp32 logits).

What this code shares with the ``transformers`` main-branch ``deepseek_v41`` port:

- Numerics (``numerics="model"``, :mod:`.variant`): the window KV is rounded to FP8 (block 32),
  the compressed latents to FP4 (e4m3 scales, block 16) and the indexer q / k to FP4 (block 32),
  also in unquantised runs; FP8 input rounding only on linears stored FP8 / FP4 (the port
  loads none, so it never rounds inputs).
- Everything else we checked agrees with the spec and with this code: deferred pre-mix with a
  one-hot first collapse and no ``hc_head``; no per-head q norm; ratio-1 compressor without
  ``wgate``, ratio-2 fp32 pooling without ``ape``; index keys from the pre-RoPE latent
  (``k_norm(wk(latent))``, RoPE at ``ratio * j``); latest kv source's cache and latest index
  source's top-k shared by the layers after them; the candidate pre-filter (block max, newest
  block forced, later index sources masked); router ``gate_temp``, ``1e-20`` normalisation,
  ``bias_vl`` present on every router.
- fp32 order: on CPU every reference op but attention rounds as the port does (mHC normalises
  the flat streams before projecting; the Engram gate multiplies its two RMS statistics
  first). The port's attention sums over its call's dense key axis (all prefill tokens, then
  all entries, masked), ours over each row's index list; with the sums taken over the port's
  axis the whole prefill is bit-identical to the port (``benchmarks/fidelity/v41_port_parity``,
  ``port_layout``). The port's own axis depends on how the sequence is split into calls.
"""

from __future__ import annotations

import torch

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.engram import EngramHasher
from deepinfer.engine.model.engram_hashing import EngramHashLayout
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch
from deepinfer.engine.model.stack import DecoderStack, StepOutput, collect_taps
from deepinfer.engine.model.vision_model import VisionModel
from deepinfer.engine.model.yoco import PrefillTruncation, prefill_truncation, run_consumers


class DeepseekV41Model(VisionModel, DecoderStack):
    def build_variant(self, factory: LinearFactory, device) -> None:
        self.engram_hasher = None
        self.build_vision(factory.dtype, device)
        self.truncation: PrefillTruncation | None = None

    def set_prefill_truncation(self, mode: str, keep_tokens: int, max_draft: int = 0) -> None:
        """YoCo prefill truncation (:mod:`.yoco`) for the steps built from a batch (given
        metadata, as decode graphs and training pass, runs every row as ``off``)."""
        self.truncation = prefill_truncation(self.config, mode, keep_tokens, max_draft)

    def forward_step(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepOutput:
        if self.truncation is None or metadata is not None:
            return super().forward_step(batch, cache, metadata)
        ctx = self.step_context(batch, cache)
        h = self.embed_tokens(batch)
        streams = h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        streams, pre = self.mix.run(self.layers[: self.truncation.boundary], streams, ctx)
        streams, pre, ctx, rows, seen = run_consumers(self, streams, pre, ctx, batch, cache)
        logits = self.logits(streams, pre, seen.logits_indices)
        return StepOutput(logits, collect_taps(ctx), streams, pre, rows)

    def bind_engram(self, token_map: torch.Tensor) -> None:
        """Attach the tokenizer-derived compressed token map ``[vocab]`` the Engram layers hash
        with (:func:`deepinfer.engine.model.engram_hashing.compressed_token_map`)."""
        c = self.config
        if not c.engram_layer_ids:
            return
        pad = c.engram_pad_token_id if c.engram_pad_token_id is not None else c.pad_token_id
        layout = EngramHashLayout.from_model_config(c)
        device = self.embed.weight.device
        self.engram_hasher = EngramHasher(layout, token_map, pad, device)

    def step_context(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepContext:
        ctx = super().step_context(batch, cache, metadata)
        ctx.image_mask = self.image_mask(batch)
        if self.config.engram_layer_ids:
            if ctx.image_mask is None:
                ctx.token_mask = torch.ones_like(batch.input_ids, dtype=torch.bool)
            else:
                ctx.token_mask = ~ctx.image_mask
            ctx.engram_rows = self.engram_rows(batch, cache, ctx.image_mask)
            for k, layer_id in enumerate(self.config.engram_layer_ids):
                # host tables start gathering this step's rows while the first layers run
                self.layers[layer_id].engram.embed.prefetch(ctx.engram_rows[:, k])
        return ctx

    def engram_rows(
        self, batch: ForwardBatch, cache: ModelCache, image_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``image_mask``: image-span rows, Engram barriers (no n-gram reaches across them)."""
        if self.engram_hasher is None:
            raise RuntimeError(
                "engram_layer_ids is set but no token map is bound: call "
                "model.bind_engram(compressed_token_map(tokenizer)) before the first forward"
            )
        counts = batch.cu_seqlens_q.diff().long()
        # output_size: no device-to-host read of the total (capturable in a CUDA graph)
        token_slots = batch.state_slots.long().repeat_interleave(
            counts, output_size=batch.input_ids.shape[0]
        )
        history = cache.extra["engram_history"]
        return self.engram_hasher.row_ids(
            batch.input_ids, batch.positions, token_slots, history, image_mask
        )
