"""Confidence-scheduled verification (``EngineConfig.spec_varlen``): before laying a step
out, decide how many of its scheduled drafts each request verifies.

The scheduler schedules every proposed draft (its token budget and blocks cover them); the
runner then keeps, per request, the prefix :func:`deepinfer.spec.plan_verify_counts` chooses
from the drafts' confidences (from the proposal, one step old, no device sync) and the step-cost
curve, counting the step's other tokens (prefill chunks, plain decodes) as fixed. Requests then
verify 1 .. K+1 rows each. The scheduler learns what was verified from the number of tokens a
request emits: positions past them are simply not counted as computed.
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.spec import StepCostCurve, plan_verify_counts


def trim_verification(
    so: SchedulerOutput, proposals: dict, cost_curve: StepCostCurve
) -> SchedulerOutput:
    """``so`` with each verifying request's drafts cut to the planned prefix.

    proposals: ``{request id: Proposal}`` whose ``confidences`` belong to the scheduled drafts
    (a request without one counts its drafts as certain).
    """
    verifying = [
        r for r, d in so.scheduled_spec_token_ids.items() if d and r in so.num_scheduled_tokens
    ]
    if not verifying:
        return so
    counts = [len(so.scheduled_spec_token_ids[r]) for r in verifying]
    rows = []
    for request_id, n in zip(verifying, counts):
        proposal = proposals.get(request_id)
        known = proposal.confidences[:n] if proposal is not None else []
        rows.append([min(max(c, 0.0), 1.0) for c in known] + [1.0] * (n - len(known)))
    verify_tokens = sum(counts) + len(verifying)
    other = so.total_num_scheduled_tokens - verify_tokens
    plan = plan_verify_counts(rows, counts, cost_curve, num_other_tokens=other)
    scheduled = dict(so.num_scheduled_tokens)
    spec = dict(so.scheduled_spec_token_ids)
    for request_id, n, keep in zip(verifying, counts, plan.num_verify_drafts):
        scheduled[request_id] -= n - keep
        spec[request_id] = spec[request_id][:keep]
    return replace(so, num_scheduled_tokens=scheduled, scheduled_spec_token_ids=spec)
