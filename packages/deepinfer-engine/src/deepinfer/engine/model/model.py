"""The V4 and V4.1 stacks, ``build_model`` and ``expected_tensors``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.block import Block
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.hc import HyperHead
from deepinfer.engine.model.layers import Embedding, LinearFactory, RMSNorm
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.rope import RopeTables


@dataclass(frozen=True)
class StepOutput:
    """What a forward returns besides logits, for the draft stages.

    logits ``[L, vocab]`` fp32 (rows ``logits_indices``); taps ``[T, n_taps * D]`` fp32 (the
    DSpark taps in ``dspark_target_layer_ids`` order, None without them); streams ``[T, nc, D]``
    the final streams before the head collapse; pre ``[T, nc]`` V4.1's final collapse weights.
    """

    logits: torch.Tensor
    taps: torch.Tensor | None
    streams: torch.Tensor
    pre: torch.Tensor | None = None


def collect_taps(ctx: StepContext) -> torch.Tensor | None:
    if not ctx.tap_layers:
        return None
    return torch.cat([ctx.taps[i] for i in ctx.tap_layers], dim=-1)


def attach_draft_stages(model: nn.Module, factory: LinearFactory) -> None:
    """``model.mtp``: the checkpoint's draft stages (DSpark or V4's MTP block), if any."""
    from deepinfer.engine.model.mtp import build_draft_stages

    stages = build_draft_stages(model.config, factory)
    if stages is not None:
        model.mtp = stages


class DeepseekV4Model(nn.Module):
    """``embed`` -> ``hc_mult`` streams -> ``layers`` -> ``hc_head`` collapse -> ``norm`` ->
    ``head`` (fp32 logits). ``include_mtp`` adds the draft stages as ``mtp``."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        include_mtp: bool = False,
    ):
        super().__init__()
        self.config = config
        factory = LinearFactory(config, dtype, device)
        c = config
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Block(c, i, factory) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.head = factory.dense(c.hidden_size, c.vocab_size)
        self._build_head(device)
        self.rope = RopeTables(c, "cpu" if device in (None, "meta") else device)
        if include_mtp:
            attach_draft_stages(self, factory)

    def _build_head(self, device) -> None:
        c = self.config
        nc = c.hc_mult
        for name, shape in (("fn", (nc, nc * c.hidden_size)), ("base", (nc,)), ("scale", (1,))):
            t = torch.empty(shape, dtype=torch.float32, device=device)
            self.register_parameter(f"hc_head_{name}", nn.Parameter(t, requires_grad=False))
        self.hc_head = HyperHead(c)

    def step_context(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepContext:
        """``metadata``: index lists built elsewhere (fixed-shape decode metadata); None
        builds them from ``batch``."""
        md = metadata or build_metadata(
            batch, self.config, cache.layout, cache.ring_size, compact=True
        )
        angles = {
            compressed: RopeTables.angles(self.rope.table(compressed), batch.positions)
            for compressed in (False, True)
        }
        ctx = StepContext(md, cache, batch.input_ids, batch.positions, self.rope, angles)
        ctx.tap_layers = self.config.dspark_target_layer_ids
        return ctx

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Logits ``[L, vocab]`` fp32 for ``batch.logits_indices`` (all tokens if None)."""
        return self.forward_step(batch, cache).logits

    def forward_step(
        self, batch: ForwardBatch, cache: ModelCache, metadata: AttentionMetadata | None = None
    ) -> StepOutput:
        ctx = self.step_context(batch, cache, metadata)
        h = self.embed(batch.input_ids)
        streams = h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        for layer in self.layers:
            streams = layer(streams, ctx)
            ctx.record_tap(layer.layer_id, streams)  # V4-0731 taps the layer output (spec C2)
        logits = self.logits(streams, batch.logits_indices)
        return StepOutput(logits, collect_taps(ctx), streams)

    def logits(self, streams: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None:
            streams = streams[rows]
        y = self.hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return K.linear(self.norm(y).float(), self.head.weight, out_dtype=torch.float32)


def build_model(
    config: ModelConfig,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    *,
    include_mtp: bool = False,
) -> nn.Module:
    """The model of ``config.architecture`` with uninitialised weights on ``device``.

    ``dtype`` is the dtype of the tensors the checkpoint stores as bf16 (use fp32 for tight
    tests); fp32 tensors, FP8 / FP4 weights and their scales keep their stored dtypes.
    ``include_mtp`` also builds the draft stages ``mtp.*`` (speculative decoding).
    """
    if config.is_v41:
        from deepinfer.engine.model.model_v41 import DeepseekV41Model

        return DeepseekV41Model(config, dtype=dtype, device=device, include_mtp=include_mtp)
    return DeepseekV4Model(config, dtype=dtype, device=device, include_mtp=include_mtp)


def expected_tensors(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, *, include_mtp: bool = True
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor the model needs: ``name -> (shape, dtype)`` (vision excluded)."""
    model = build_model(config, device="meta", dtype=dtype, include_mtp=include_mtp)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
