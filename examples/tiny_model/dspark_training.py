"""Training the DSpark draft stages on a frozen target, through the engine's own draft modules.

One training step over ``B`` sequences of ``T`` tokens (each a prefill from position 0):

1. the frozen target runs once (no grad) -> taps ``[B*T, n_taps*D]`` and logits ``[B*T, V]``;
2. :func:`teacher_forced_drafts` seeds every stage's window from the taps with
   ``DSparkDraft.seed`` and runs the draft block of *every* anchor at once exactly as
   ``DSparkDraft.propose`` does (``_block_inputs`` / ``run_stages`` / ``collapse`` / shared head),
   then the Markov and confidence heads teacher-forced on the real tokens;
3. :func:`dspark_loss`: position-weighted CE + total variation + confidence BCE.

Anchor ``p`` (``0 <= p <= T - 2``): the last seeded position is ``p``, the block sits at
``p+1 .. p+K`` with the real token ``x[p+1]`` in slot 0 (the other slots the noise token), and
draft ``i`` predicts position ``p+2+i``, whose target distribution is the target's logits row
``p+1+i`` (teacher-forced on the real prefix; valid while ``p+1+i <= T-1``). The Markov head's
previous token of draft ``i`` is the real ``x[p+1+i]`` (the anchor for ``i = 0``).

Why the in-place ring writes are harmless: each stage reads its ring (``torch.cat`` copies it)
before writing the block rows of all anchors into it, and each stage has its own ring, so no
anchor ever reads another anchor's block rows. The rings hold ``T + K`` rows per sequence, so
the seeded main positions never wrap and each anchor reads exactly positions ``p-W+1 .. p``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer.kernels as K
from deepinfer.engine.model.cache import CacheLayout
from deepinfer.engine.model.mtp import DSparkDraft


class DraftWindows:
    """A ``ModelCache`` stand-in holding only the draft stages' window rings: one state slot
    per training sequence, ``ring_size`` rows each (``"{layer}.window"`` ``[B * ring, hd]``)."""

    def __init__(
        self,
        draft: DSparkDraft,
        num_sequences: int,
        ring_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.layout = CacheLayout(num_blocks=1, num_slots=num_sequences)
        self.ring_size, self.dtype = ring_size, dtype
        head_dim = draft.config.head_dim
        self.tensors = {
            f"{stage.layer_id}.window": torch.zeros(
                num_sequences * ring_size, head_dim, dtype=dtype, device=device
            )
            for stage in draft
        }
        self.extra: dict[str, torch.Tensor] = {}
        self.formats: dict = {}  # float rings: no packed formats (:attr:`ModelCache.formats`)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def rows(self, key: str) -> torch.Tensor:
        """The rows attention reads: float, as training needs (:meth:`ModelCache.rows`)."""
        return self.tensors[key]

    def write(self, key: str, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` at rows ``dst`` (:meth:`ModelCache.write` without packing)."""
        tensor = self.tensors[key]
        tensor.index_copy_(0, dst, values.to(tensor.dtype))


@dataclass(frozen=True)
class DraftOutputs:
    """Teacher-forced draft outputs of all anchors, ``N = B * (T - 1)`` anchor-major.

    logits ``[N, K, V]`` fp32 (base + Markov correction); confidence_logits ``[N, K]`` fp32;
    target_rows ``[N, K]`` int64: the flat target row ``b*T + p+1+i`` each draft is compared
    with (clamped to the sequence end); valid ``[N, K]`` bool: ``p+1+i <= T-1``;
    next_tokens ``[N, K]`` int64: the real token ``x[p+2+i]`` (clamped; None if unknown).
    """

    logits: torch.Tensor
    confidence_logits: torch.Tensor
    target_rows: torch.Tensor
    valid: torch.Tensor
    next_tokens: torch.Tensor | None = None


def anchor_layout(num_sequences: int, seq_len: int, block_size: int, device) -> dict:
    """Index tensors of all anchors: last positions, slots, target rows, validity."""
    per_seq = seq_len - 1
    last = torch.arange(per_seq, device=device).repeat(num_sequences)
    seq = torch.arange(num_sequences, device=device).repeat_interleave(per_seq)
    step = torch.arange(block_size, device=device)
    position = last[:, None] + 1 + step[None, :]  # the target row position of draft i
    valid = position <= seq_len - 1
    rows = seq[:, None] * seq_len + position.clamp(max=seq_len - 1)
    return {"last_positions": last, "slots": seq, "target_rows": rows, "valid": valid}


def teacher_forced_drafts(
    draft: DSparkDraft,
    embed: nn.Module,
    head_weight: torch.Tensor,
    rope,
    taps: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    block_size: int | None = None,
) -> DraftOutputs:
    """Draft logits and confidences of every anchor of ``input_ids`` ``[B, T]`` (int64).

    taps ``[B*T, n_taps*D]`` fp32: the target's taps, row ``b*T + t`` = position ``t`` of
    sequence ``b``. Differentiable in the draft stages' parameters (``main_proj`` / ``wkv`` via
    the seeded windows included); ``embed`` and ``head_weight`` are the target's.
    """
    num_sequences, seq_len = input_ids.shape
    k = block_size or draft.config.dspark_block_size
    device = input_ids.device
    ring = max(seq_len + k, draft.config.sliding_window + k)
    dtype = draft[0].main_norm.weight.dtype
    windows = DraftWindows(draft, num_sequences, ring, dtype=dtype, device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_sequences)
    token_slots = torch.arange(num_sequences, device=device).repeat_interleave(seq_len)
    draft.seed(taps, positions, token_slots, windows, rope)

    anchors = anchor_layout(num_sequences, seq_len, k, device)
    flat_ids = input_ids.reshape(-1)
    anchor_tokens = flat_ids[anchors["target_rows"][:, 0]]  # x[p+1]
    streams, ctx = draft._block_inputs(
        anchor_tokens, anchors["last_positions"], anchors["slots"], windows, embed, rope, k
    )
    streams, pre = draft.run_stages(streams, ctx)
    last = draft[len(draft) - 1]
    hidden = draft.mix.collapse(last, streams, pre)  # [N*K, D] pre-norm, as DSparkDraft.propose
    base = K.linear(last.norm(hidden).float(), head_weight, out_dtype=torch.float32)
    prev = flat_ids[anchors["target_rows"]].reshape(-1)  # x[p+1+i]: the real previous token
    emb = last.markov_head.embedding(prev)
    logits = base + last.markov_head.bias(emb)
    confidence = last.confidence_head(hidden, emb)
    n = anchor_tokens.shape[0]
    next_rows = (anchors["target_rows"] + 1).clamp(max=flat_ids.shape[0] - 1)
    return DraftOutputs(
        logits=logits.view(n, k, -1),
        confidence_logits=confidence.view(n, k),
        target_rows=anchors["target_rows"],
        valid=anchors["valid"],
        next_tokens=flat_ids[next_rows],
    )


CONFIDENCE_TARGETS = ("tv", "greedy")


@dataclass(frozen=True)
class LossWeights:
    """Weights of the DSpark loss terms.

    Position ``i`` weighs ``exp(-i / decay)``. ``confidence_target``: what the confidence head
    learns to predict: ``"tv"`` = ``1 - TV(p, q)`` (DeepSpec; the acceptance probability of
    speculative sampling at temperature 1) or ``"greedy"`` = whether the draft's argmax is the
    target's greedy token (the acceptance event of greedy verification). ``off_path``: the weight of a draft position
    whose earlier real tokens ``x[p+2 .. p+1+i]`` are *not* the target's greedy tokens there.
    On the greedy path the teacher-forced label is exactly the target's greedy continuation
    the drafts are verified against; off it, the label depends on real tokens the draft block
    never sees, so those examples get less weight.
    """

    cross_entropy: float = 1.0
    total_variation: float = 1.0
    confidence: float = 1.0
    decay: float = 4.0
    off_path: float = 0.2
    confidence_target: str = "tv"

    def __post_init__(self) -> None:
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(
                f"LossWeights.confidence_target = {self.confidence_target!r}: expected one of "
                f"{CONFIDENCE_TARGETS}"
            )
        for name in ("cross_entropy", "total_variation", "confidence", "off_path"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossWeights.{name} = {getattr(self, name)}: expected >= 0")
        if self.decay <= 0:
            raise ValueError(f"LossWeights.decay = {self.decay}: expected > 0")

    def positions(self, block_size: int, device=None) -> torch.Tensor:
        """``[K]`` fp32 position weights."""
        i = torch.arange(block_size, dtype=torch.float32, device=device)
        return torch.exp(-i / self.decay)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``0.5 * sum |p - q|`` over the last dim (probabilities)."""
    return 0.5 * (p - q).abs().sum(-1)


def on_greedy_path(labels: torch.Tensor, next_tokens: torch.Tensor | None) -> torch.Tensor:
    """``[N, K]`` bool: the real tokens before draft ``i`` (``x[p+2 .. p+1+i]``) all equal the
    target's greedy labels of drafts ``0 .. i-1`` (always True for ``i = 0``)."""
    if next_tokens is None:
        return torch.ones_like(labels, dtype=torch.bool)
    match = (next_tokens == labels).long().cumprod(1).bool()
    return torch.cat([torch.ones_like(match[:, :1]), match[:, :-1]], 1)


def dspark_loss(
    outputs: DraftOutputs, target_logits: torch.Tensor, weights: LossWeights = LossWeights()
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DSpark loss and detached metrics.

    target_logits ``[B*T, V]`` fp32 (frozen target, teacher-forced). Per draft position ``i``:
    ``CE(q_i, argmax p_i) + TV(p_i, q_i) + BCE(sigmoid(c_i), 1 - TV(p_i, q_i))`` (the BCE target
    detached; see :attr:`LossWeights.confidence_target`), weighted by ``w_i`` (times ``off_path`` off the greedy path) and averaged over
    valid positions. Metric ``agree``: per position, how often the draft's argmax is the
    target's greedy token on the greedy path (the conditional greedy acceptance rate);
    ``tau``: ``1 + sum_i prod_{j<=i} agree_j``, the accepted length per verify step it implies.
    """
    rows, valid = outputs.target_rows, outputs.valid
    n, k = rows.shape
    with torch.no_grad():
        target = target_logits[rows.reshape(-1)].float()
        labels = target.argmax(-1)
        p = torch.softmax(target, -1)
        on_path = on_greedy_path(labels.view(n, k), outputs.next_tokens) & valid
    logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])
    q = torch.softmax(logits, -1)
    tv = total_variation(p, q)
    ce = F.cross_entropy(logits, labels, reduction="none")
    conf = outputs.confidence_logits.reshape(-1)
    if weights.confidence_target == "greedy":
        conf_target = (logits.detach().argmax(-1) == labels).float()
    else:
        conf_target = (1 - tv).detach()
    bce = F.binary_cross_entropy_with_logits(conf, conf_target, reduction="none")
    path_weight = torch.where(on_path, 1.0, weights.off_path) * valid
    w = (weights.positions(k, rows.device)[None, :] * path_weight).reshape(-1)
    denom = w.sum().clamp(min=1e-6)

    def mean(term: torch.Tensor) -> torch.Tensor:
        return (term * w).sum() / denom

    loss = (
        weights.cross_entropy * mean(ce)
        + weights.total_variation * mean(tv)
        + weights.confidence * mean(bce)
    )
    with torch.no_grad():
        agree = (logits.argmax(-1) == labels).float().view(n, k)
        agree = (agree * on_path).sum(0) / on_path.float().sum(0).clamp(min=1)
        metrics = {
            "loss": loss.detach(),
            "ce": mean(ce).detach(),
            "tv": mean(tv).detach(),
            "bce": mean(bce).detach(),
            "tau": 1 + agree.cumprod(0).sum(),
            "agree": agree,  # [K]
        }
    return loss, metrics


@torch.no_grad()
def run_target(model: nn.Module, batch, cache, metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over a prefill ``ForwardBatch``: (taps ``[T, n_taps*D]`` fp32,
    logits ``[T, V]`` fp32) for every token; ``metadata``: prebuilt index lists (optional)."""
    if metadata is None:
        out = model.forward_step(batch, cache)
    else:
        out = model.forward_step(batch, cache, metadata)
    return out.taps, out.logits


def draft_parameters(draft: DSparkDraft) -> list[nn.Parameter]:
    """Make the draft stages trainable; return their float parameters (the embedding and the
    head belong to the target and stay frozen)."""
    params = []
    for name, p in draft.named_parameters():
        # the router bias only selects experts (no gradient reaches it); bias_vl: image tokens
        trainable = p.dtype.is_floating_point and not name.endswith(("gate.bias", "gate.bias_vl"))
        p.requires_grad_(trainable)
        if trainable:
            params.append(p)
    return params


def draft_state_dict(draft: DSparkDraft) -> dict[str, torch.Tensor]:
    """The draft stages in checkpoint names (``mtp.{stage}.*``), detached, on the CPU."""
    return {f"mtp.{k}": v.detach().cpu().clone() for k, v in draft.state_dict().items()}


def init_draft_heads_(draft: DSparkDraft) -> None:
    """Start the Markov correction and the confidence head at zero: the draft begins as its
    base logits with confidence 0.5 (the stages themselves keep their initialisation)."""
    last = draft[len(draft) - 1]
    with torch.no_grad():
        last.markov_head.projection.zero_()
        last.confidence_head.proj.weight.zero_()
        rank = last.markov_head.embedding_table.shape[1]
        last.markov_head.embedding_table.normal_(0.0, 1.0 / math.sqrt(rank))
