"""The draft stages ``mtp.*``: V4's MTP block (spec 2.9) and the DSpark drafter (2.10, 7.5).

A draft stage is a ratio-0 (sliding-window) decoder block at layer id ``num_layers + k`` with a
few extra tensors:

- DSpark stage 0: ``main_proj [D, n_taps * D]`` (FP8) and ``main_norm [D]``: the projection
  of the target's tap hidden states (``main_x``) whose K=V seeds every stage's window;
- DSpark last stage: ``norm [D]``, the Markov head and the confidence head (``mtp_heads``) and,
  in V4, the stage's own ``hc_head_fn / base / scale``;
- V4's MTP block (``mtp.0``): ``e_proj``, ``h_proj`` (FP8 ``[D, D]``), ``enorm``, ``hnorm``,
  ``norm``, ``hc_head_*``.

The embedding and the LM head are the target's. How the engine drives DSpark (per step):

1. the target forward collects ``taps = concat_l mean_streams(h_l)`` ``[T, n_taps * D]`` at
   ``dspark_target_layer_ids`` (V4.1: the streams entering the layer, after Engram; V4-0731:
   the layer's output; ``forward_step(...).taps``) and calls :meth:`DSparkDraft.seed` for all
   processed tokens (prefill chunks included; rows of rejected tokens are overwritten later);
2. after acceptance, :meth:`DSparkDraft.propose` with each request's *anchor* (the token the
   target just produced, which goes to position ``p + 1`` where ``p`` is the last position the
   target processed and seeded) returns ``K`` drafts for positions ``p + 2 .. p + K + 1``,
   their Markov-corrected logits and confidence logits; the target then verifies
   ``[anchor, drafts]`` at ``p + 1 .. p + K + 1`` (``K + 1`` rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.block import Block
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.context import StepContext
from deepinfer.engine.model.hc import HyperHead
from deepinfer.engine.model.layers import LinearFactory, RMSNorm
from deepinfer.engine.model.mtp_heads import ConfidenceHead, MarkovHead
from deepinfer.engine.model.mtp_window import draft_block, seed_rows
from deepinfer.engine.model.rope import RopeTables
from deepinfer.engine.model.variant import variant_of

Sampler = Callable[[torch.Tensor, int], torch.Tensor]


def is_dspark(config: ModelConfig) -> bool:
    return config.dspark_block_size > 0 and config.num_mtp_layers > 0


def draft_config(config: ModelConfig) -> ModelConfig:
    """The config the draft blocks are built from: backbone + ratio-0 draft layers, and the
    drafter's own expert counts (V4.1: 128 experts, top-3)."""
    return config.with_overrides(
        num_layers=config.num_layers + config.num_mtp_layers,
        compress_ratios=config.compress_ratios + config.mtp_compress_ratios,
        mtp_compress_ratios=(),
        n_routed_experts=config.dspark_n_routed_experts or config.n_routed_experts,
        num_experts_per_tok=config.dspark_num_experts_per_tok or config.num_experts_per_tok,
    )


class DSparkStage(Block):
    """One DSpark stage (``mtp.{index}``): a sliding-window block plus stage extras."""

    def __init__(
        self, config: ModelConfig, index: int, num_stages: int, factory: LinearFactory
    ) -> None:
        stage_cfg = draft_config(config)
        super().__init__(stage_cfg, config.num_layers + index, factory)
        c, f = config, factory
        dim, norm = c.hidden_size, dict(dtype=f.dtype, device=f.device)
        self.index, self.is_last = index, index == num_stages - 1
        if index == 0:
            self.main_proj = f.quantised(len(c.dspark_target_layer_ids) * dim, dim)
            self.main_norm = RMSNorm(dim, c.rms_norm_eps, **norm)
        if self.is_last:
            self.norm = RMSNorm(dim, c.rms_norm_eps, **norm)
            family, rank = variant_of(c).name, c.dspark_markov_rank
            self.markov_head = MarkovHead(c.vocab_size, rank, family, **norm)
            self.confidence_head = ConfidenceHead(dim, rank, **norm)
            variant_of(c).mix.attach_head(self, c, f.device)


@dataclass(frozen=True)
class DraftProposal:
    """What one draft step returns, request-major.

    tokens ``[B, K]`` int64; logits ``[B, K, vocab]`` fp32 (base + Markov correction: the
    draft distribution before the request's sampling steps); confidence_logits ``[B, K]`` fp32
    (``sigmoid`` of it = acceptance probability given the earlier drafts were accepted).
    """

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence_logits: torch.Tensor


def greedy(logits: torch.Tensor, index: int) -> torch.Tensor:
    """Default draft sampler: argmax (lowest index on ties)."""
    return logits.argmax(dim=-1)


class DSparkDraft(nn.ModuleList):
    """The model's ``mtp`` list of DSpark stages, with the seed / propose driver."""

    def __init__(self, config: ModelConfig, factory: LinearFactory) -> None:
        n = config.num_mtp_layers
        super().__init__(DSparkStage(config, k, n, factory) for k in range(n))
        self.config = config
        self.mix = variant_of(config).mix

    def allocate(self, cache: ModelCache) -> None:
        """Add each stage's window ring to ``cache`` (rows ``num_slots * ring_size``)."""
        rows = cache.layout.num_slots * cache.ring_size
        for stage in self:
            ring = torch.zeros(rows, self.config.head_dim, dtype=cache.dtype, device=_device(cache))
            cache.tensors[f"{stage.layer_id}.window"] = ring

    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps ``[T, n_taps * D]`` (fp32 means) -> ``main_norm(main_proj(taps))`` ``[T, D]``."""
        first = self[0]
        return first.main_norm(first.main_proj(taps.to(first.main_norm.weight.dtype)))

    def seed(
        self,
        taps: torch.Tensor,
        positions: torch.Tensor,
        token_slots: torch.Tensor,
        cache: ModelCache,
        rope: RopeTables,
    ) -> None:
        """Write every stage's window K=V of the main positions ``[T]`` from the taps."""
        x = self.main_x(taps)
        cos, sin = RopeTables.angles(rope.main, positions)
        src, dst = seed_rows(positions, token_slots, cache.ring_size, cache.layout.num_slots)
        for stage in self:
            # the same K=V rounding as the stage's own window rows (FP8 sim when simulating)
            attn = stage.attn
            kv = attn.kv_norm(attn.wkv(x))
            kv = attn.simulate_kv(K.apply_rope(kv, cos, sin, out=kv))
            ring = cache[f"{stage.layer_id}.window"]
            ring.index_copy_(0, dst, kv[src].to(ring.dtype))

    def propose(
        self,
        anchor_tokens: torch.Tensor,
        last_positions: torch.Tensor,
        slots: torch.Tensor,
        cache: ModelCache,
        embed: nn.Module,
        head_weight: torch.Tensor,
        rope: RopeTables,
        *,
        block_size: int | None = None,
        sample: Sampler = greedy,
    ) -> DraftProposal:
        """Draft ``K`` tokens after each request's anchor token.

        anchor_tokens ``[B]`` int64: the token the target just produced (block slot 0, at
        position ``p + 1``; the other slots hold ``dspark_noise_token_id``);
        last_positions ``[B]``: ``p``, the last position whose taps were seeded (the block
        attends to the window of main positions ending at ``p`` and sits at ``p+1 .. p+K``);
        slots ``[B]``: state slots. Draft ``i`` is the prediction for position ``p + 2 + i``:
        ``sample(logits [B, vocab], i) -> [B]`` picks it from its Markov-corrected logits
        (greedy by default; key a seeded sampler by that position).
        """
        c = self.config
        k = block_size or c.dspark_block_size
        streams, ctx = self._block_inputs(
            anchor_tokens, last_positions, slots, cache, embed, rope, k
        )
        hidden, base = self.block_logits(streams, ctx, head_weight)
        return self.markov_decode(hidden, base, anchor_tokens, k, sample)

    def block_logits(
        self, streams: torch.Tensor, ctx: StepContext, head_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stage over the block streams ``[N, nc, D]``: the last stage's collapsed hidden
        ``[N, D]`` (pre-norm, what the confidence head reads) and its base logits ``[N, vocab]``
        fp32 (before the Markov correction). No host work: a CUDA graph can capture it."""
        streams, pre = self.run_stages(streams, ctx)
        last = self[len(self) - 1]
        hidden = self.mix.collapse(last, streams, pre)
        return hidden, K.linear(last.norm(hidden).float(), head_weight, out_dtype=torch.float32)

    def run_stages(
        self, streams: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All stages over the block streams ``[N, nc, D]``, threaded as the backbone's
        blocks are (V4.1 also returns the last ``pre``)."""
        return self.mix.run(self, streams, ctx)

    def _block_inputs(self, anchor_tokens, last_positions, slots, cache, embed, rope, k):
        c = self.config
        ids, positions, md = draft_block(anchor_tokens, last_positions, slots, k,
                                         c.dspark_noise_token_id, c.sliding_window,
                                         cache.ring_size, cache.layout.num_slots)  # fmt: skip
        return self.block_context(ids, positions, md, cache, embed, rope)

    def block_context(self, ids, positions, md, cache, embed, rope):
        """(block streams ``[N, nc, D]``, step context) of the block tokens ``ids`` ``[N]`` at
        ``positions`` ``[N]`` with the draft metadata ``md``."""
        angles = {False: RopeTables.angles(rope.main, positions)}
        ctx = StepContext(md, cache, ids, positions, rope, angles)
        return embed(ids).unsqueeze(1).repeat(1, self.config.hc_mult, 1), ctx

    def markov_decode(
        self, hidden, base, anchor_tokens, k: int, sample: Sampler = greedy
    ) -> DraftProposal:
        """The drafts of :meth:`block_logits`' output (``[B * K, .]``, request-major)."""
        return self._markov_decode(self[len(self) - 1], hidden, base, anchor_tokens, k, sample)

    @staticmethod
    def _markov_decode(last, hidden, base, anchor_tokens, k, sample) -> DraftProposal:
        """Sequential over the block: correct, pick, score; only the low-rank head is serial."""
        num_requests = anchor_tokens.shape[0]
        hidden, base = hidden.unflatten(0, (num_requests, k)), base.unflatten(0, (num_requests, k))
        prev, tokens, logits, conf = anchor_tokens, [], [], []
        for i in range(k):
            emb = last.markov_head.embedding(prev)
            corrected = base[:, i] + last.markov_head.bias(emb)
            prev = sample(corrected, i)
            tokens.append(prev)
            logits.append(corrected)
            conf.append(last.confidence_head(hidden[:, i], emb))
        return DraftProposal(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1))


def _device(cache: ModelCache) -> torch.device:
    return next(iter(cache.tensors.values())).device


class MTPBlock(Block):
    """V4-Flash's MTP block ``mtp.0`` (spec 2.9): predicts the token after next.

    Extras: ``e_proj``, ``h_proj`` (FP8 ``[D, D]``), ``enorm``, ``hnorm``, ``norm``,
    ``hc_head_*``. It is a sliding-window layer at id ``num_layers``: run it inside the target's
    flat batch with the target's :class:`StepContext` (window index lists are layer-agnostic;
    its ring ``"{num_layers}.window"`` comes from :meth:`allocate`).
    """

    def __init__(self, config: ModelConfig, factory: LinearFactory) -> None:
        super().__init__(draft_config(config), config.num_layers, factory)
        c, f = config, factory
        dim, norm = c.hidden_size, dict(dtype=f.dtype, device=f.device)
        self.e_proj = f.quantised(dim, dim)
        self.h_proj = f.quantised(dim, dim)
        self.enorm = RMSNorm(dim, c.rms_norm_eps, **norm)
        self.hnorm = RMSNorm(dim, c.rms_norm_eps, **norm)
        self.norm = RMSNorm(dim, c.rms_norm_eps, **norm)
        HyperHead.attach(self, c, f.device)

    def allocate(self, cache: ModelCache) -> None:
        rows = cache.layout.num_slots * cache.ring_size
        head_dim = self.attn.head_dim
        ring = torch.zeros(rows, head_dim, dtype=cache.dtype, device=_device(cache))
        cache.tensors[f"{self.layer_id}.window"] = ring

    def forward(  # type: ignore[override]
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        embed: nn.Module,
        ctx: StepContext,
    ) -> torch.Tensor:
        """streams ``[T, nc, D]``: the target's final streams (before ``hc_head``) at positions
        ``t``; next_ids ``[T]``: the tokens at ``t + 1``. Returns the block's streams; their
        :meth:`logits` predict the token at ``t + 2``.

        ``x = e_proj(enorm(embed(next_ids)))`` (broadcast over streams) ``+ h_proj(hnorm(h))``
        (per stream), then the decoder block.
        """
        e = self.e_proj(self.enorm(embed(next_ids)))
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return super().forward(x.to(streams.dtype), ctx)

    def logits(self, streams: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """``[N, nc, D]`` -> fp32 logits ``[N, vocab]`` (own ``hc_head``, ``norm``, shared head)."""
        y = self.hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return K.linear(self.norm(y).float(), head_weight, out_dtype=torch.float32)


def build_draft_stages(config: ModelConfig, factory: LinearFactory) -> nn.ModuleList | None:
    """The model's ``mtp`` list: DSpark stages, V4's single MTP block, or None."""
    if config.num_mtp_layers == 0:
        return None
    if is_dspark(config):
        return DSparkDraft(config, factory)
    return nn.ModuleList([MTPBlock(config, factory)])
