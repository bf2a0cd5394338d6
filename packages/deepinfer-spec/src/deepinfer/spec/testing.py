"""Toy target and draft models for testing speculative decoding end to end, without a network.

A "model" here is a first-order Markov chain over a small vocabulary: the next-token
distribution depends only on the previous token (``transition[prev]``). That is enough to
check the properties that matter — greedy and seed-exact speculation reproduce
non-speculative decoding token for token, rejection sampling reproduces the target's joint
distribution — because verify row ``j`` must see exactly the prefix the drafts imply.
All loops are batched over rows; nothing here is fast or meant for production.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer.sampling import rng
from deepinfer.spec.acceptance import (
    AcceptanceResult,
    accept_greedy,
    accept_rejection,
    accept_seed_exact,
    draw_categorical,
)
from deepinfer.spec.cost import StepCostCurve
from deepinfer.spec.planner import plan_verification

Mode = Literal["greedy", "seed_exact", "rejection"]


def random_transition(
    vocab_size: int, generator: torch.Generator, *, sharpness: float = 1.0
) -> torch.Tensor:
    """A random row-stochastic matrix ``[V, V]`` float32 with every entry positive."""
    logits = torch.randn(vocab_size, vocab_size, generator=generator) * sharpness
    return torch.softmax(logits, dim=-1)


def blend(target: torch.Tensor, other: torch.Tensor, weight: float) -> torch.Tensor:
    """A draft that is ``weight`` of the target's transition and ``1 - weight`` of another."""
    return weight * target + (1.0 - weight) * other


def next_token(
    transition: torch.Tensor,
    previous: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    is_greedy: bool,
    stream: int,
) -> torch.Tensor:
    """One token per row ``[N]`` int64: argmax, or a seeded draw keyed (seed, position, stream)."""
    probs = transition[previous]
    if is_greedy:
        return probs.argmax(dim=-1)
    return draw_categorical(probs, seeds, positions, stream)


def generate_plain(
    target: torch.Tensor,
    first_previous: torch.Tensor,
    seeds: torch.Tensor,
    start_positions: torch.Tensor,
    num_tokens: int,
    *,
    is_greedy: bool,
) -> torch.Tensor:
    """Non-speculative decoding: ``[N, num_tokens]`` int64 tokens after ``first_previous``."""
    out, previous = [], first_previous
    for step in range(num_tokens):
        previous = next_token(
            target, previous, seeds, start_positions + step, is_greedy=is_greedy,
            stream=rng.STREAM_SAMPLE,
        )  # fmt: skip
        out.append(previous)
    return torch.stack(out, dim=1)


def propose_drafts(
    draft: torch.Tensor,
    anchor: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_drafts: int,
    *,
    is_greedy: bool,
    stream: int = rng.STREAM_DRAFT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential drafting: tokens ``[N, K]`` int64 and their distributions ``[N, K, V]``.

    Draft ``j`` is drawn with the key ``(seed, positions + j, stream)``.
    """
    tokens, probs, previous = [], [], anchor
    for j in range(num_drafts):
        probs.append(draft[previous])
        previous = next_token(
            draft, previous, seeds, positions + j, is_greedy=is_greedy, stream=stream
        )
        tokens.append(previous)
    vocab = draft.shape[-1]
    if num_drafts == 0:
        empty = torch.empty(anchor.shape[0], 0, dtype=torch.int64)
        return empty, torch.empty(anchor.shape[0], 0, vocab)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def verify(
    target: torch.Tensor,
    anchor: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    mode: Mode,
) -> AcceptanceResult:
    """Run the toy target over ``[anchor, drafts]`` and accept with the rule ``mode`` names."""
    prefix = torch.cat([anchor[:, None], draft_tokens], dim=1)  # row j conditions on prefix[j]
    target_probs = target[prefix]
    if mode == "rejection":
        return accept_rejection(
            draft_tokens, num_draft_tokens, draft_probs, target_probs, seeds, positions
        )
    if mode == "greedy":
        return accept_greedy(draft_tokens, num_draft_tokens, target_probs.argmax(dim=-1))
    rows, width = prefix.shape
    row_positions = (positions[:, None] + torch.arange(width)[None, :]).reshape(-1)
    sampled = draw_categorical(
        target_probs.reshape(rows * width, -1),
        seeds.repeat_interleave(width),
        row_positions,
        rng.STREAM_SAMPLE,
    ).view(rows, width)
    return accept_seed_exact(draft_tokens, num_draft_tokens, sampled)


@dataclass(frozen=True)
class SpeculativeRun:
    """Result of :func:`generate_speculative`.

    tokens: ``[N, num_tokens]`` int64; num_steps: ``[N]`` int64 verify steps per row;
    num_verified_drafts: ``[N]`` int64 drafts sent to the target per row, over all steps.
    """

    tokens: torch.Tensor
    num_steps: torch.Tensor
    num_verified_drafts: torch.Tensor


def _verify_counts(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    cost_curve: StepCostCurve | None,
) -> torch.Tensor:
    """Fixed length, or confidence-scheduled with the draft's own ``q(d)`` as the confidence."""
    if cost_curve is None or draft_tokens.shape[1] == 0:
        return num_draft_tokens
    confidences = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    return plan_verification(confidences, num_draft_tokens, cost_curve).num_verify_drafts


def generate_speculative(
    target: torch.Tensor,
    draft: torch.Tensor,
    first_previous: torch.Tensor,
    seeds: torch.Tensor,
    start_positions: torch.Tensor,
    num_tokens: int,
    num_draft_tokens: torch.Tensor,
    mode: Mode,
    *,
    draft_stream: int = rng.STREAM_DRAFT,
    cost_curve: StepCostCurve | None = None,
) -> SpeculativeRun:
    """Speculative decoding of ``num_tokens`` per row, each row with its own draft count.

    ``draft_stream`` keys the drafter's noise (``STREAM_SAMPLE`` couples it with the target's).
    With ``cost_curve`` each step verifies the prefix :func:`plan_verification` picks for the
    whole batch (variable length), else all ``num_draft_tokens[b]`` drafts.
    """
    rows = first_previous.shape[0]
    max_drafts = int(num_draft_tokens.max()) if rows else 0
    buffer = torch.full((rows, num_tokens + max_drafts + 1), -1, dtype=torch.int64)
    lengths = torch.zeros(rows, dtype=torch.int64)
    num_steps = torch.zeros(rows, dtype=torch.int64)
    num_verified = torch.zeros(rows, dtype=torch.int64)
    anchor = first_previous.clone()
    while bool((lengths < num_tokens).any()):
        positions = start_positions + lengths
        is_greedy = mode == "greedy"
        drafts, probs = propose_drafts(
            draft, anchor, seeds, positions, max_drafts, is_greedy=is_greedy, stream=draft_stream
        )
        counts = _verify_counts(drafts, probs, num_draft_tokens, cost_curve)
        result = verify(target, anchor, drafts, probs, counts, seeds, positions, mode)
        is_active = lengths < num_tokens
        slots = torch.arange(max_drafts + 1)[None, :]
        is_written = is_active[:, None] & (slots < result.num_output_tokens[:, None])
        row, slot = is_written.nonzero(as_tuple=True)
        column = (lengths[row] + slot).clamp(max=buffer.shape[1] - 1)
        buffer[row, column] = result.output_tokens[row, slot]
        lengths = torch.where(is_active, lengths + result.num_output_tokens, lengths)
        num_steps += is_active.to(torch.int64)
        num_verified += torch.where(is_active, counts, 0)
        anchor = torch.where(is_active, result.final_tokens, anchor)
    return SpeculativeRun(buffer[:, :num_tokens], num_steps, num_verified)


__all__ = [
    "Mode",
    "SpeculativeRun",
    "blend",
    "chi_square_p_value",
    "generate_plain",
    "generate_speculative",
    "next_token",
    "propose_drafts",
    "random_transition",
    "verify",
]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of observed ``counts`` against ``probs``.

    Both flat ``[C]``; cells with zero probability must have zero counts (else returns 0).
    """
    counts = counts.to(torch.float64).reshape(-1)
    probs = probs.to(torch.float64).reshape(-1)
    expected = counts.sum() * probs
    is_possible = expected > 0
    if bool((counts[~is_possible] > 0).any()):
        return 0.0
    statistic = (((counts - expected) ** 2)[is_possible] / expected[is_possible]).sum()
    dof = int(is_possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))
