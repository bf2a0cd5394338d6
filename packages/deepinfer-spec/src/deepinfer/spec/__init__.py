"""deepinfer.spec: speculative-decoding algorithms as pure tensor functions.

Acceptance (:mod:`~deepinfer.spec.acceptance`): greedy prefix match, seed-exact match and
chain rejection sampling over padded draft batches. Verification planning
(:mod:`~deepinfer.spec.planner`, :mod:`~deepinfer.spec.cost`): how many drafts each request
verifies, from per-draft confidences and a measured step-cost curve. Layout helpers
(:mod:`~deepinfer.spec.layout`) move rows between padded and flat varlen batches.
"""

from deepinfer.spec.acceptance import (
    AcceptanceResult,
    accept_by_match,
    accept_greedy,
    accept_rejection,
    accept_seed_exact,
    draw_categorical,
    matched_prefix,
)
from deepinfer.spec.cost import StepCostCurve
from deepinfer.spec.layout import (
    PAD_TOKEN_ID,
    VerifyRows,
    build_verify_rows,
    counts_from_cu,
    cu_from_counts,
    cu_num_verify_tokens,
    pad_drafts,
    pad_verify_rows,
    padded_to_varlen,
    varlen_to_padded,
)
from deepinfer.spec.planner import (
    VerifyPlan,
    plan_verification,
    plan_verify_counts,
    split_verify_slots,
    survival_probabilities,
)
from deepinfer.spec.version import __version__

__all__ = [
    "PAD_TOKEN_ID",
    "AcceptanceResult",
    "StepCostCurve",
    "VerifyPlan",
    "VerifyRows",
    "__version__",
    "accept_by_match",
    "accept_greedy",
    "accept_rejection",
    "accept_seed_exact",
    "build_verify_rows",
    "counts_from_cu",
    "cu_from_counts",
    "cu_num_verify_tokens",
    "draw_categorical",
    "matched_prefix",
    "pad_drafts",
    "pad_verify_rows",
    "padded_to_varlen",
    "plan_verification",
    "plan_verify_counts",
    "split_verify_slots",
    "survival_probabilities",
    "varlen_to_padded",
]
