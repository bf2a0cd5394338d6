"""Exact acceptance of draft tokens: greedy prefix match, seed-exact match, rejection sampling.

All three take a padded batch (see :mod:`deepinfer.spec.layout`):

* ``draft_tokens`` ``[B, K]`` int64 — request ``b`` proposes ``draft_tokens[b, :n_b]`` with
  ``n_b = num_draft_tokens[b]`` (``[B]`` int, ``0 <= n_b <= K``); later slots are ignored, and a
  draft equal to :data:`~deepinfer.spec.layout.PAD_TOKEN_ID` is always rejected.
* target rows ``[B, K + 1, ...]`` — row ``j`` is the target's output for the position of draft
  ``j`` (computed from the committed tokens plus drafts ``0 .. j-1``); row ``n_b`` is the bonus
  row used when every draft is accepted.

and return an :class:`AcceptanceResult` (:func:`matched_prefix`: one request's match count on
host lists). Every function is a handful of batched tensor ops on the
inputs' device: no host synchronisation, no Python loop over requests, and each request's result
depends only on its own rows (batch invariant).

Random draws (rejection sampling only) come from :mod:`deepinfer.sampling.rng`, keyed by
``(seed, absolute position, stream)``: the coin for draft ``j`` of request ``b`` uses
``(seeds[b], positions[b] + j, STREAM_ACCEPT)`` and the final (residual or bonus) token at
position ``positions[b] + a_b`` uses ``(seeds[b], positions[b] + a_b, STREAM_RESIDUAL)``, where
``positions[b]`` is the absolute position of the first draft token (the number of tokens the
request had committed before this step) and ``a_b`` the accepted count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling import rng
from deepinfer.spec.layout import PAD_TOKEN_ID


@dataclass(frozen=True)
class AcceptanceResult:
    """What one verify step commits per request.

    num_accepted: ``[B]`` int64, accepted drafts ``a_b`` in ``0 .. num_draft_tokens[b]``.
    output_tokens: ``[B, K + 1]`` int64; ``output_tokens[b, :a_b]`` are the accepted drafts,
        ``output_tokens[b, a_b]`` the final token (the target's correction at the first rejected
        draft, or the bonus token after the last draft), and the rest :data:`PAD_TOKEN_ID`.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor

    @property
    def num_output_tokens(self) -> torch.Tensor:
        """Tokens committed per request, ``[B]`` int64: accepted drafts plus the final token."""
        return self.num_accepted + 1

    @property
    def final_tokens(self) -> torch.Tensor:
        """The corrected or bonus token per request, ``[B]`` int64 (the next step's anchor)."""
        return self.output_tokens.gather(1, self.num_accepted[:, None]).squeeze(1)

    def where(self, use_self: torch.Tensor, other: AcceptanceResult) -> AcceptanceResult:
        """Row-wise merge: rows with ``use_self[b]`` (``[B]`` bool) from ``self``, others from
        ``other`` (same shapes) — e.g. greedy and sampled requests verified in one batch."""
        if self.output_tokens.shape != other.output_tokens.shape:
            raise ValueError(
                f"other.output_tokens.shape={tuple(other.output_tokens.shape)}: expected "
                f"{tuple(self.output_tokens.shape)}"
            )
        return AcceptanceResult(
            num_accepted=torch.where(use_self, self.num_accepted, other.num_accepted),
            output_tokens=torch.where(use_self[:, None], self.output_tokens, other.output_tokens),
        )


def _check_drafts(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Validate the padded draft batch; returns ``(B, K)``."""
    if draft_tokens.dim() != 2 or draft_tokens.is_floating_point():
        raise ValueError(
            f"draft_tokens: shape {tuple(draft_tokens.shape)} dtype {draft_tokens.dtype}; "
            "expected an integer tensor [B, K]"
        )
    batch, max_drafts = draft_tokens.shape
    if num_draft_tokens.shape != (batch,) or num_draft_tokens.is_floating_point():
        raise ValueError(
            f"num_draft_tokens: shape {tuple(num_draft_tokens.shape)} dtype "
            f"{num_draft_tokens.dtype}; expected an integer tensor [{batch}]"
        )
    return batch, max_drafts


def _check_rows(name: str, rows: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(rows.shape[: len(expected)]) != expected:
        raise ValueError(f"{name}: shape {tuple(rows.shape)}; expected leading dims {expected}")


def _is_live_draft(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool: the slot holds a real draft (inside the request's count, not padding)."""
    slots = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)
    in_count = slots[None, :] < num_draft_tokens.to(draft_tokens.device)[:, None]
    return in_count & (draft_tokens != PAD_TOKEN_ID)


def _count_accepted_prefix(is_accepted: torch.Tensor) -> torch.Tensor:
    """Length ``[B]`` int64 of the leading run of ``True`` in each row of ``[B, K]`` bool."""
    return torch.cumprod(is_accepted.to(torch.int64), dim=1).sum(dim=1)


def _assemble_output(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_tokens: torch.Tensor
) -> AcceptanceResult:
    """Accepted drafts, then the final token, then padding: ``[B, K + 1]`` int64."""
    batch, max_drafts = draft_tokens.shape
    pad = torch.full((batch, 1), PAD_TOKEN_ID, dtype=torch.int64, device=draft_tokens.device)
    drafts = torch.cat([draft_tokens.to(torch.int64), pad], dim=1)
    slots = torch.arange(max_drafts + 1, device=draft_tokens.device)[None, :]
    output = torch.where(slots < num_accepted[:, None], drafts, pad)
    output = torch.where(
        slots == num_accepted[:, None], final_tokens[:, None].to(torch.int64), output
    )
    return AcceptanceResult(num_accepted=num_accepted, output_tokens=output)


def accept_by_match(
    draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor, target_tokens: torch.Tensor
) -> AcceptanceResult:
    """Accept the longest prefix of drafts equal to the target's own tokens.

    target_tokens: ``[B, K + 1]`` int — the token the target emits at each verify row. The final
    token is ``target_tokens[b, a_b]``. Shared by :func:`accept_greedy` and
    :func:`accept_seed_exact`, which differ only in how the caller made ``target_tokens``.
    """
    batch, max_drafts = _check_drafts(draft_tokens, num_draft_tokens)
    _check_rows("target_tokens", target_tokens, (batch, max_drafts + 1))
    target_tokens = target_tokens.to(torch.int64)
    is_match = draft_tokens.to(torch.int64) == target_tokens[:, :max_drafts]
    is_accepted = is_match & _is_live_draft(draft_tokens, num_draft_tokens)
    num_accepted = _count_accepted_prefix(is_accepted)
    final_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return _assemble_output(draft_tokens, num_accepted, final_tokens)


def matched_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """:func:`accept_by_match`'s accepted count for one request, on host lists (for a caller
    that holds the target's tokens on the host already): how many leading ``drafts`` equal
    ``targets`` at their row; a :data:`~deepinfer.spec.layout.PAD_TOKEN_ID` draft never does."""
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target or draft == PAD_TOKEN_ID:
            break
        accepted += 1
    return accepted


def accept_greedy(
    draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> AcceptanceResult:
    """Greedy prefix match: drafts are accepted while they equal the target's argmax.

    target_argmax: ``[B, K + 1]`` int, ``argmax`` of the target logits at each verify row. The
    committed tokens are exactly those non-speculative greedy decoding would produce.
    """
    return accept_by_match(draft_tokens, num_draft_tokens, target_argmax)


def accept_seed_exact(
    draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor, target_sampled: torch.Tensor
) -> AcceptanceResult:
    """Seed-exact acceptance: a draft is accepted iff it equals the token the target samples there.

    target_sampled: ``[B, K + 1]`` int — at row ``j`` the token the target's own sampler draws
    from that row's processed distribution with the request's seed at the row's absolute
    position (the same key non-speculative decoding uses). Since row ``j`` sees exactly the
    committed prefix whenever it matters, seeded outputs are identical with and without
    speculation. With independent draft noise acceptance is lower than rejection sampling's
    (``sum_x p(x) q(x)`` versus ``sum_x min(p(x), q(x))`` per draft); drawing each draft with the
    target's own key (seed, position, ``STREAM_SAMPLE``) couples the two draws so they agree
    whenever both distributions are close, which recovers most of the gap (still exact).
    """
    return accept_by_match(draft_tokens, num_draft_tokens, target_sampled)


def draw_categorical(
    weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int
) -> torch.Tensor:
    """One seeded draw per row from non-negative, unnormalised ``weights`` ``[N, V]`` float.

    Exponential race (equivalent to Gumbel-max): ``argmax_v weights[v] / E_v`` with
    ``E_v = -log(u_v)`` and ``u = rng.uniform(seeds, positions, stream, V)``. Returns ``[N]``
    int64. A row must have some positive weight.
    """
    noise = rng.uniform(seeds, positions, stream, weights.shape[-1])
    exponential = -torch.log(noise)
    return torch.argmax(weights.to(torch.float32) / exponential, dim=-1)


def _draft_probs_of_tokens(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """``q(d)`` per draft slot, ``[B, K]`` float32 (1 for deterministic drafts)."""
    if draft_probs is None:
        return torch.ones(draft_tokens.shape, dtype=torch.float32, device=draft_tokens.device)
    index = draft_tokens.clamp(min=0).to(torch.int64)[..., None]
    return draft_probs.gather(-1, index).squeeze(-1).to(torch.float32)


def _final_weights(
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """Unnormalised distribution ``[B, V]`` of the final token.

    ``max(p - q, 0)`` at the first rejected row, ``p`` at the bonus row (all accepted), and
    ``p`` as well where the residual is empty (``p == q``, so rejection had probability 0).
    """
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    target_row = target_probs[rows, num_accepted].to(torch.float32)
    if draft_tokens.shape[1] == 0:
        return target_row
    draft_row_index = num_accepted.clamp(max=draft_tokens.shape[1] - 1)
    rejected_token = draft_tokens[rows, draft_row_index].to(torch.int64)
    # A padding draft was never proposed: its row falls back to plain sampling from p.
    was_rejected = (num_accepted < num_draft_tokens.to(num_accepted.device)) & (
        rejected_token != PAD_TOKEN_ID
    )
    if draft_probs is None:
        one_hot_index = rejected_token.clamp(min=0)[:, None]
        draft_row = torch.zeros_like(target_row).scatter_(1, one_hot_index, 1.0)
    else:
        draft_row = draft_probs[rows, draft_row_index].to(torch.float32)
    draft_row = torch.where(was_rejected[:, None], draft_row, torch.zeros_like(draft_row))
    residual = (target_row - draft_row).clamp(min=0.0)
    is_empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(is_empty, target_row, residual)


def accept_rejection(
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> AcceptanceResult:
    """Chain rejection sampling: the committed tokens follow the target distribution exactly.

    draft_probs: ``[B, K, V]`` float — the processed distribution ``q`` each draft was sampled
        from, or ``None`` for deterministic (e.g. argmax) drafts, treated as one-hot ``q``.
    target_probs: ``[B, K + 1, V]`` float — the processed target distribution ``p`` per verify
        row (after temperature / top-k / top-p / grammar masks; rows sum to 1).
    seeds, positions: ``[B]`` int64 — request seed and absolute position of draft 0.

    Draft ``j`` is accepted iff ``u_j * q_j(d_j) < p_j(d_j)`` (probability ``min(1, p/q)``) for
    the coin ``u_j`` keyed ``(seed, positions + j, STREAM_ACCEPT)``; the first rejection ends the
    prefix. The final token is drawn from ``normalise(max(p_a - q_a, 0))`` at the rejected row
    ``a``, or from ``p`` at the bonus row when all drafts pass, keyed
    ``(seed, positions + a, STREAM_RESIDUAL)``. No damping of the residual: exact up to the
    24-bit resolution of the coins.
    """
    batch, max_drafts = _check_drafts(draft_tokens, num_draft_tokens)
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs: shape {tuple(target_probs.shape)}; expected [B, K + 1, V]")
    _check_rows("target_probs", target_probs, (batch, max_drafts + 1))
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, (batch, max_drafts, target_probs.shape[-1]))
    _check_rows("seeds", seeds, (batch,))
    _check_rows("positions", positions, (batch,))

    offsets = torch.arange(max_drafts, device=draft_tokens.device)
    coins = rng.uniform(
        seeds.to(torch.int64).repeat_interleave(max_drafts),
        (positions.to(torch.int64)[:, None] + offsets[None, :]).reshape(-1),
        rng.STREAM_ACCEPT,
        1,
    ).view(batch, max_drafts)
    token_index = draft_tokens.clamp(min=0).to(torch.int64)[..., None]
    target_of_draft = target_probs[:, :max_drafts].gather(-1, token_index).squeeze(-1)
    draft_of_draft = _draft_probs_of_tokens(draft_tokens, draft_probs)
    is_accepted = coins * draft_of_draft < target_of_draft.to(torch.float32)
    is_accepted &= _is_live_draft(draft_tokens, num_draft_tokens)
    num_accepted = _count_accepted_prefix(is_accepted)

    weights = _final_weights(
        draft_tokens, num_draft_tokens, draft_probs, target_probs, num_accepted
    )
    final_positions = positions.to(torch.int64) + num_accepted
    final_tokens = draw_categorical(
        weights, seeds.to(torch.int64), final_positions, rng.STREAM_RESIDUAL
    )
    return _assemble_output(draft_tokens, num_accepted, final_tokens)


__all__ = [
    "AcceptanceResult",
    "accept_by_match",
    "accept_greedy",
    "accept_rejection",
    "accept_seed_exact",
    "draw_categorical",
]
