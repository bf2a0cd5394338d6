"""Confidence-scheduled verification: how many drafts each request verifies this step.

Inputs per request ``b`` and draft position ``j``: the confidence ``c[b, j]`` (probability
that draft ``j`` is accepted given drafts ``0 .. j-1`` were), so the survival
``s[b, j] = c[b, 0] * ... * c[b, j]`` is the probability that draft ``j`` is committed. A step
that verifies ``m`` drafts in total on top of the one mandatory row per request (and any
prefill tokens sharing the step) is expected to commit ``B + (sum of the chosen s)`` tokens.

:func:`plan_verification` picks ``m`` maximising expected committed tokens per unit of step
cost; :func:`split_verify_slots` hands ``m`` slots to the ``(request, position)`` pairs of
highest survival. Survival never increases along a request, so the chosen pairs always form a
prefix of each request's drafts (ties are broken by request, then position, which keeps that
true). The split is pure torch with no host sync, so an engine can fix ``m`` on the host from
last step's confidences and redo the split on the device with the live ones.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from operator import mul

import torch

from deepinfer.spec.cost import StepCostCurve


@dataclass(frozen=True)
class VerifyPlan:
    """The plan for one step.

    num_verify_drafts: ``[B]`` int64, drafts request ``b`` verifies (a prefix of its drafts);
        it sends ``num_verify_drafts[b] + 1`` rows to the target (a list from
        :func:`plan_verify_counts`).
    num_step_tokens: tokens in the step: other tokens + ``B`` + ``sum(num_verify_drafts)``.
    expected_tokens: ``B`` + sum of the survival of the verified drafts.
    cost: the curve's cost of the step plus the fixed cost.
    """

    num_verify_drafts: torch.Tensor | list[int]
    num_step_tokens: int
    expected_tokens: float
    cost: float

    @property
    def tokens_per_cost(self) -> float:
        """Expected committed tokens per unit of cost (the maximised objective)."""
        return self.expected_tokens / self.cost


def _live_slots(num_draft_tokens: torch.Tensor, max_drafts: int, device: torch.device):
    """``[B, K]`` bool: slot ``j`` of request ``b`` holds a draft."""
    slots = torch.arange(max_drafts, device=device)
    return slots[None, :] < num_draft_tokens.to(device)[:, None]


def survival_probabilities(
    confidences: torch.Tensor, num_draft_tokens: torch.Tensor
) -> torch.Tensor:
    """Cumulative products of confidences, ``[B, K]`` float32; 0 past each request's drafts.

    confidences: ``[B, K]`` float in ``[0, 1]`` (clamped into it; NaN counts as 0, so a bad
    confidence can only cost speed, never break the prefix rule); num_draft_tokens: ``[B]`` int.
    """
    is_live = _live_slots(num_draft_tokens, confidences.shape[1], confidences.device)
    clamped = torch.nan_to_num(confidences.to(torch.float32), nan=0.0).clamp(0.0, 1.0)
    return torch.where(is_live, torch.cumprod(clamped, dim=1), torch.zeros_like(clamped))


def _rank_pairs(survival: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Flat indices ``b * K + j`` of every live pair, best first (ties: lower index first).

    Dead pairs (past a request's drafts) get key -1 and sort last.
    """
    is_live = _live_slots(num_draft_tokens, survival.shape[1], survival.device)
    keys = torch.where(is_live, survival, torch.full_like(survival, -1.0)).reshape(-1)
    return torch.sort(keys, descending=True, stable=True).indices


def split_verify_slots(
    confidences: torch.Tensor, num_draft_tokens: torch.Tensor, num_slots: int | torch.Tensor
) -> torch.Tensor:
    """Give ``num_slots`` draft slots to the pairs of highest survival; ``[B]`` int64 per request.

    confidences: ``[B, K]`` float in ``[0, 1]``; num_draft_tokens: ``[B]`` int. num_slots: an int
    or 0-dim int tensor on the same device (no host sync); it is capped at the number of drafts.
    Each request's count is a prefix length ``<= num_draft_tokens[b]``.
    """
    batch, max_drafts = confidences.shape
    survival = survival_probabilities(confidences, num_draft_tokens)
    order = _rank_pairs(survival, num_draft_tokens)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    is_live = _live_slots(num_draft_tokens, max_drafts, confidences.device).reshape(-1)
    is_chosen = (rank < num_slots) & is_live
    return is_chosen.view(batch, max_drafts).sum(dim=1).to(torch.int64)


def _check_plan_inputs(confidences: torch.Tensor, num_draft_tokens: torch.Tensor) -> None:
    if confidences.dim() != 2 or not confidences.is_floating_point():
        raise ValueError(
            f"confidences: shape {tuple(confidences.shape)} dtype {confidences.dtype}; "
            "expected a float tensor [B, K]"
        )
    if num_draft_tokens.shape != confidences.shape[:1]:
        raise ValueError(
            f"num_draft_tokens: shape {tuple(num_draft_tokens.shape)}; "
            f"expected [{confidences.shape[0]}]"
        )
    if bool(torch.isnan(confidences).any()) or bool(((confidences < 0) | (confidences > 1)).any()):
        raise ValueError("confidences: expected values in [0, 1] (found NaN or out of range)")
    counts = num_draft_tokens.to(torch.int64)
    if bool(((counts < 0) | (counts > confidences.shape[1])).any()):
        raise ValueError(
            f"num_draft_tokens={counts.tolist()}: expected values in [0, {confidences.shape[1]}]"
        )


def plan_verification(
    confidences: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    cost_curve: StepCostCurve,
    *,
    num_other_tokens: int = 0,
    fixed_cost: float = 0.0,
    max_num_step_tokens: int | None = None,
) -> VerifyPlan:
    """Choose the drafts to verify that maximise expected committed tokens per unit of cost.

    confidences: ``[B, K]`` float in ``[0, 1]`` (host tensors; this runs on the scheduler side).
    num_draft_tokens: ``[B]`` int, drafts available per request (0 for requests without any).
    cost_curve: cost of a step as a function of its total token count.
    num_other_tokens: tokens already in the step that commit nothing now (prefill chunks).
    fixed_cost: per-step cost independent of the verify width (drafter, sampler), same unit.
    max_num_step_tokens: optional cap on the step's total tokens (e.g. the token budget).

    Maximises ``(B + sum of the m best survivals) / (cost(num_other + B + m) + fixed_cost)``
    over ``m`` by one sorted cumulative sum (the smallest ``m`` wins ties), then splits the
    ``m`` slots as :func:`split_verify_slots` does. Deterministic for fixed inputs; computed on
    host lists by :func:`plan_verify_counts`.
    """
    _check_plan_inputs(confidences, num_draft_tokens)
    rows = confidences.detach().cpu().to(torch.float32).tolist()
    counts = num_draft_tokens.detach().cpu().to(torch.int64).tolist()
    plan = plan_verify_counts(
        rows, counts, cost_curve, num_other_tokens=num_other_tokens, fixed_cost=fixed_cost,
        max_num_step_tokens=max_num_step_tokens,
    )  # fmt: skip
    return replace(plan, num_verify_drafts=torch.tensor(plan.num_verify_drafts, dtype=torch.int64))


def plan_verify_counts(
    confidences: Sequence[Sequence[float]],
    num_draft_tokens: Sequence[int],
    cost_curve: StepCostCurve,
    *,
    num_other_tokens: int = 0,
    fixed_cost: float = 0.0,
    max_num_step_tokens: int | None = None,
) -> VerifyPlan:
    """:func:`plan_verification` on host lists, in plain Python (an engine plans every step:
    a few hundred floats, no torch op), with the same result bit for bit; its
    ``num_verify_drafts`` is a list.

    confidences: per request at least its ``num_draft_tokens[b]`` confidences in ``[0, 1]``
    (the rest ignored). Survivals are rounded to float32 as :func:`survival_probabilities`
    gives them (float64 running products, each rounded), ranked as :func:`split_verify_slots`
    ranks them (descending, ties by request then position).
    """
    if num_other_tokens < 0 or fixed_cost < 0:
        raise ValueError(
            f"num_other_tokens={num_other_tokens}, fixed_cost={fixed_cost}: expected >= 0"
        )
    batch = len(num_draft_tokens)
    base_tokens = num_other_tokens + batch
    survival: list[float] = []
    owner: list[int] = []
    for b, n in enumerate(num_draft_tokens):
        row = confidences[b][:n]
        if n < 0 or len(row) < n:
            raise ValueError(f"num_draft_tokens[{b}]={n}: expected 0..{len(confidences[b])}")
        if not all(0.0 <= c <= 1.0 for c in row):  # (NaN fails too)
            raise ValueError("confidences: expected values in [0, 1] (found NaN or out of range)")
        survival.extend(array("f", accumulate(array("f", row), mul)))
        owner.extend([b] * n)
    order = sorted(range(len(survival)), key=survival.__getitem__, reverse=True)  # stable
    num_live = len(order)
    if max_num_step_tokens is not None:
        if max_num_step_tokens < base_tokens:
            raise ValueError(
                f"max_num_step_tokens={max_num_step_tokens}: expected at least the mandatory "
                f"{base_tokens} tokens (num_other_tokens + one per request)"
            )
        num_live = min(num_live, max_num_step_tokens - base_tokens)
    costs = [c + fixed_cost for c in cost_curve.cost_range(base_tokens, num_live + 1)]
    best, best_expected = 0, float(batch)
    best_ratio, gain = best_expected / costs[0], 0.0
    for m in range(1, num_live + 1):
        gain += survival[order[m - 1]]
        expected = batch + gain
        if expected / costs[m] > best_ratio:  # the first maximum: fewest tokens
            best, best_expected, best_ratio = m, expected, expected / costs[m]
    counts = [0] * batch
    for pair in order[:best]:
        counts[owner[pair]] += 1
    return VerifyPlan(counts, base_tokens + best, best_expected, costs[best])


__all__ = [
    "VerifyPlan",
    "plan_verification",
    "plan_verify_counts",
    "split_verify_slots",
    "survival_probabilities",
]
