"""Dense-masked training twin of ``sparse_mqa_sink`` for fixed-shape training batches.

In a training batch (``tiny_common.training_batch``: ``B`` sequences of ``S`` tokens, each a
prefill from position 0 in its own state slot and its own consecutive arena blocks) the flat
``kv`` an attention layer hands to ``sparse_mqa_sink`` is::

    [ ring rows of all slots (B * ring) | this step's tokens (T = B * S) | arena (B * A) ]

(the arena part only in compressed layers: the kv-source layer's cache, shared by the layers
after it), and every index of query ``t`` of sequence ``b`` points into sequence ``b``'s own
rows: its window keys are step tokens ``b * S + j`` and its compressed entries arena rows
``b * A + e``. So per sequence the keys are ``S + A`` rows and attention is two dense batched
matmuls with a mask built from the index lists: a key listed ``c`` times in a row contributes
``c * exp(logit)`` (the reference sums over the list), i.e. the logit gets ``log c``
(``-inf`` for ``c = 0``; ``-1`` holes count nothing). The per-head sink joins the denominator.

The backward recomputes the probabilities from the saved log-sum-exp (FlashAttention style),
so a layer keeps only ``q``, the per-sequence keys, the log-count mask and the output.

:class:`DenseAttention` holds the layout and the check: an index outside its query's
sequence (or in the ring rows) cannot be expressed by the mask. ``verify=True`` checks every
call on the host (one device sync) and falls back to the gather twin when the structure does
not hold; ``verify=False`` counts such indices on the device (they are dropped from the
mask) and :meth:`DenseAttention.raise_on_violations` fails at the caller's next sync point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceBlocks:
    """How a training batch lays its sequences out in ``kv``: ``seq_len`` tokens per sequence,
    ``ring_size`` window-ring rows per state slot (before the step tokens)."""

    seq_len: int
    ring_size: int

    def __post_init__(self) -> None:
        for name in ("seq_len", "ring_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SequenceBlocks.{name} = {getattr(self, name)}: expected > 0")

    def split(self, num_tokens: int, num_rows: int) -> tuple[int, int] | None:
        """``(num_sequences, arena rows per sequence)`` of a call with ``num_tokens`` query
        rows and ``num_rows`` kv rows, or None when the shapes cannot be this layout."""
        if num_tokens == 0 or num_tokens % self.seq_len:
            return None
        num_seqs = num_tokens // self.seq_len
        arena = num_rows - num_seqs * self.ring_size - num_tokens
        if arena < 0 or arena % num_seqs:
            return None
        return num_seqs, arena // num_seqs


@torch.no_grad()
def key_columns(
    indices: torch.Tensor, blocks: SequenceBlocks, num_seqs: int, arena_per_seq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map flat kv rows to per-sequence key columns.

    indices ``[T, K]`` int (``-1`` = hole). Returns (columns ``[T, K]`` int64 in
    ``0 .. S + A - 1``: step token ``j`` -> ``j``, arena entry ``e`` -> ``S + e``; in-structure
    ``[T, K]`` bool; out-of-structure count ``[]`` int64 (valid indices the mask cannot hold).
    """
    seq_len, num_tokens = blocks.seq_len, indices.shape[0]
    window_base = num_seqs * blocks.ring_size
    idx = indices.long()
    valid = idx >= 0
    rel = idx - window_base
    in_step = (rel >= 0) & (rel < num_tokens)
    rel_arena = rel - num_tokens
    in_arena = (rel_arena >= 0) & (rel_arena < num_seqs * arena_per_seq)
    per_arena = max(arena_per_seq, 1)
    seq_of_key = torch.where(in_step, rel.div(seq_len, rounding_mode="floor"), -1)
    seq_of_key = torch.where(in_arena, rel_arena.div(per_arena, rounding_mode="floor"), seq_of_key)
    column = torch.where(in_step, rel.remainder(seq_len), seq_len + rel_arena.remainder(per_arena))
    seq_of_query = torch.arange(num_tokens, device=idx.device).div(seq_len, rounding_mode="floor")
    ok = valid & (in_step | in_arena) & (seq_of_key == seq_of_query[:, None])
    return column, ok, (valid & ~ok).sum()


@torch.no_grad()
def log_count_mask(column: torch.Tensor, ok: torch.Tensor, num_seqs: int, width: int):
    """``[B, S, width]`` fp32: ``log`` of how often each key column is listed in each query
    row (``-inf`` where never); entries with ``ok`` False count nothing.

    Counted by one ``index_add_`` into ``[T, width + 1]``: what is not counted goes to its own
    row's spare column (half the entries of a training batch are holes: one shared spare cell
    would serialise them all on the same atomic)."""
    num_tokens = column.shape[0]
    row_width = width + 1
    rows = torch.arange(num_tokens, device=column.device)[:, None] * row_width
    flat = (rows + torch.where(ok, column, width)).reshape(-1)
    counts = torch.zeros(num_tokens * row_width, dtype=torch.float32, device=column.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts.view(num_tokens, row_width)[:, :width].log().view(num_seqs, -1, width)


class DenseSinkAttention(torch.autograd.Function):
    """Per-sequence attention with a log-count mask and a per-head sink.

    q ``[B, H, S, D]`` fp32 contiguous, keys ``[B, N, D]`` fp32 (K = V), log_counts
    ``[B, S, N]`` fp32 (no grad), sink ``[H]`` fp32 -> ``[B, H, S, D]`` fp32.
    """

    @staticmethod
    def forward(ctx, q, keys, log_counts, sink, scale):
        b, h, s, d = q.shape
        logits = torch.bmm(q.view(b, h * s, d), keys.transpose(1, 2)).mul_(scale)
        logits = logits.view(b, h, s, -1).add_(log_counts[:, None])
        sink_logit = sink.view(1, h, 1)
        peak = torch.maximum(logits.amax(-1), sink_logit)
        probs = logits.sub_(peak[..., None]).exp_()
        denom = probs.sum(-1) + torch.exp(sink_logit - peak)
        out = torch.bmm(probs.view(b, h * s, -1), keys).view(b, h, s, d).div_(denom[..., None])
        lse = peak + denom.log()
        ctx.save_for_backward(q, keys, log_counts, sink, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, keys, log_counts, sink, out, lse = ctx.saved_tensors
        scale = ctx.scale
        b, h, s, d = q.shape
        grad_out = grad_out.contiguous()
        q_flat, go_flat = q.view(b, h * s, d), grad_out.view(b, h * s, d)
        logits = torch.bmm(q_flat, keys.transpose(1, 2)).mul_(scale).view(b, h, s, -1)
        probs = logits.add_(log_counts[:, None]).sub_(lse[..., None]).exp_()
        delta = (grad_out * out).sum(-1)  # [B, H, S]
        dprobs = torch.bmm(go_flat, keys.transpose(1, 2)).view(b, h, s, -1)
        dlogits = dprobs.sub_(delta[..., None]).mul_(probs)  # softmax backward
        dl_flat, p_flat = dlogits.view(b, h * s, -1), probs.view(b, h * s, -1)
        grad_q = torch.bmm(dl_flat, keys).mul_(scale).view(b, h, s, d)
        grad_keys = torch.bmm(dl_flat.transpose(1, 2), q_flat).mul_(scale)
        grad_keys.add_(torch.bmm(p_flat.transpose(1, 2), go_flat))
        grad_sink = -(torch.exp(sink.view(1, h, 1) - lse) * delta).sum((0, 2))
        return grad_q, grad_keys, None, grad_sink, None


def sequence_keys(kv: torch.Tensor, blocks: SequenceBlocks, num_seqs: int, arena_per_seq: int):
    """``[B, S + A, D]`` fp32: each sequence's step-token rows then its arena rows."""
    base, seq_len = num_seqs * blocks.ring_size, blocks.seq_len
    kv = kv.float()
    step = kv[base : base + num_seqs * seq_len].view(num_seqs, seq_len, -1)
    if arena_per_seq == 0:
        return step
    arena = kv[base + num_seqs * seq_len :].view(num_seqs, arena_per_seq, -1)
    return torch.cat([step, arena], dim=1)


class DenseAttention:
    """The dense twin bound to one :class:`SequenceBlocks` layout, with its fallback and its
    out-of-structure check (see the module docstring)."""

    def __init__(
        self,
        blocks: SequenceBlocks,
        fallback: Callable[..., torch.Tensor],
        *,
        verify: bool = False,
    ) -> None:
        self.blocks, self.fallback, self.verify = blocks, fallback, verify
        self.violations: torch.Tensor | None = None  # device count, verify=False
        self.num_dense = self.num_fallback = 0

    def __call__(self, q, kv, indices, sink, scale: float) -> torch.Tensor:
        """The ``sparse_mqa_sink`` contract: q ``[T, H, D]``, kv ``[M, D]``, indices
        ``[T, K]`` (-1 holes), sink ``[H]`` -> ``[T, H, D]`` in ``q.dtype``; KV sources are
        joined into that one layout."""
        if not isinstance(kv, torch.Tensor):
            kv = torch.cat(tuple(kv))
        split = self.blocks.split(q.shape[0], kv.shape[0])
        if split is None:
            self.num_fallback += 1
            return self.fallback(q, kv, indices, sink, scale)
        num_seqs, arena_per_seq = split
        column, ok, outside = key_columns(indices, self.blocks, num_seqs, arena_per_seq)
        if self.verify and bool(outside):
            self.num_fallback += 1
            return self.fallback(q, kv, indices, sink, scale)
        if not self.verify:
            self.violations = outside if self.violations is None else self.violations + outside
        self.num_dense += 1
        width = self.blocks.seq_len + arena_per_seq
        log_counts = log_count_mask(column, ok, num_seqs, width)
        keys = sequence_keys(kv, self.blocks, num_seqs, arena_per_seq)
        t, h, d = q.shape
        q_seq = q.float().view(num_seqs, -1, h, d).transpose(1, 2).contiguous()
        out = DenseSinkAttention.apply(q_seq, keys, log_counts, sink.float(), float(scale))
        return out.transpose(1, 2).reshape(t, h, d).to(q.dtype)

    def raise_on_violations(self) -> None:
        """Raise if any call saw indices the mask could not hold (syncs the device)."""
        if self.violations is not None and int(self.violations):
            raise RuntimeError(
                f"dense sparse_mqa_sink twin: {int(self.violations)} indices outside their "
                f"query's sequence blocks ({self.blocks}); the training batch layout is not "
                "the one the twin assumes: use verify=True or the gather twin"
            )
