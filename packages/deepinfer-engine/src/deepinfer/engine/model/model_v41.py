"""The V4.1 stack: deferred mHC pre-mix (no ``hc_head``), CSA2 shared compressed KV, Engram.

``embed`` -> ``hc_mult`` streams -> ``layers`` (each: Engram at its layers, attention and MoE
with the previous site's ``pre``; layer 0's attention collapses stream 0) -> collapse with the
last FFN site's ``pre`` -> ``norm`` -> ``head`` (fp32 logits).

Where the ``transformers`` main-branch ``deepseek_v41`` port differs from the spec, and what
this code follows:

- Quantisation simulation: the port always fake-quantises the window KV (FP8, block 32), the
  compressed latents (FP4, e4m3 scales, block 16) and the indexer q / k (FP4, block 32), even in
  unquantised runs. We follow the spec (4.3, 7.1): only with ``quant_simulation`` (default on
  for quantised checkpoints), so an unquantised checkpoint runs plain floating point.
- Everything else we checked agrees with the spec and with this code: deferred pre-mix with a
  one-hot first collapse and no ``hc_head``; no per-head q norm; ratio-1 compressor without
  ``wgate``, ratio-2 fp32 pooling without ``ape``; index keys from the pre-RoPE latent
  (``k_norm(wk(latent))``, RoPE at ``ratio * j``); latest kv source's cache and latest index
  source's top-k shared by the layers after them; the candidate pre-filter (block max, newest
  block forced, later index sources masked); router ``gate_temp``, ``1e-20`` normalisation,
  ``bias_vl`` present on every router.
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.block import Block
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.layers import Embedding, LinearFactory, RMSNorm
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.model import StepOutput, attach_draft_stages, collect_taps
from deepinfer.engine.model.rope import RopeTables


class DeepseekV41Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        include_mtp: bool = False,
    ):
        super().__init__()
        c = self.config = config
        factory = LinearFactory(config, dtype, device)
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Block(c, i, factory) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.head = factory.dense(c.hidden_size, c.vocab_size)
        self.rope = RopeTables(c, "cpu" if device in (None, "meta") else device)
        self.engram_hasher = None
        if include_mtp:
            attach_draft_stages(self, factory)

    def bind_engram(self, token_map: torch.Tensor) -> None:
        """Attach the tokenizer-derived compressed token map ``[vocab]`` the Engram layers hash
        with (:func:`deepinfer.engine.model.engram_hashing.compressed_token_map`)."""
        from deepinfer.engine.model.engram import EngramHasher
        from deepinfer.engine.model.engram_hashing import EngramHashLayout

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
        """``metadata``: index lists built earlier for a batch of the same shape and positions
        (fixed-shape training batches reuse one); None builds them from ``batch``."""
        md = metadata or build_metadata(
            batch, self.config, cache.layout, cache.ring_size, compact=True
        )
        angles = {
            compressed: RopeTables.angles(self.rope.table(compressed), batch.positions)
            for compressed in (False, True)
        }
        ctx = StepContext(md, cache, batch.input_ids, batch.positions, self.rope, angles)
        ctx.tap_layers = self.config.dspark_target_layer_ids
        if self.config.engram_layer_ids:
            ctx.token_mask = torch.ones_like(batch.input_ids, dtype=torch.bool)
            ctx.engram_rows = self.engram_rows(batch, cache)
        return ctx

    def engram_rows(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
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
        return self.engram_hasher.row_ids(batch.input_ids, batch.positions, token_slots, history)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Logits ``[L, vocab]`` fp32 for ``batch.logits_indices`` (all tokens if None)."""
        return self.forward_step(batch, cache).logits

    def forward_step(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepOutput:
        ctx = self.step_context(batch, cache, metadata)
        h = self.embed(batch.input_ids)
        streams = h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0  # layer 0's attention reads stream 0
        for layer in self.layers:
            streams, pre = layer.forward_v41(streams, pre, ctx)
        rows = batch.logits_indices
        last, last_pre = (streams, pre) if rows is None else (streams[rows], pre[rows])
        y = self.norm(K.hc_collapse(last, last_pre))
        logits = K.linear(y.float(), self.head.weight, out_dtype=torch.float32)
        return StepOutput(logits, collect_taps(ctx), streams, pre)
