"""The selection comparisons of the conformance kit: a kernel that breaks a planted near-tie the
other way passes, one that swaps a clearly ordered pair or returns wrong weights fails, and
inputs too tied to test a selection are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.kernels.registry import OPS
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.selection import compare_route_topk, near_tie_eps

TOP_K = 6


def _route_case():
    case = next(c for c in cases_for(["route_topk"], "small") if c.name.endswith("-bias"))
    assert case.compare is compare_route_topk
    return case


def _inputs(case, seed=0):
    return case.make_inputs(torch.Generator().manual_seed(seed), torch.device("cpu"))


def _chooser(args, kwargs):
    logits, bias, _ = args
    every = torch.arange(logits.shape[-1]).expand(logits.shape[0], -1)
    plain = dict(kwargs, route_scale=1.0, renormalize=False)
    return OPS["route_hash"].reference(logits, every, **plain) + bias


def _plant_near_tie(args, kwargs, row, case, gap_in_eps):
    """Move row ``row``'s bias so its (k+1)-th expert sits ``gap_in_eps`` eps below the k-th."""
    logits, bias, k = args
    chooser = _chooser(args, kwargs)
    top = chooser[row].topk(k + 1)
    eps = near_tie_eps(chooser, case.atol, case.rtol)[row, 0]
    # a per-row bias is not the op's contract; nudge the logit of the (k+1)-th instead
    target = top.values[k - 1] - gap_in_eps * eps
    logits = logits.clone()
    lo, hi = logits[row, top.indices[k]].item(), logits[row, top.indices[k - 1]].item() + 1.0
    for _ in range(200):  # bisect the logit onto the wanted chooser value
        mid = (lo + hi) / 2
        logits[row, top.indices[k]] = mid
        if _chooser((logits, bias, k), kwargs)[row, top.indices[k]] < target:
            lo = mid
        else:
            hi = mid
    logits[row, top.indices[k]] = lo
    return (logits, bias, k), top.indices[k - 1].item(), top.indices[k].item()


def _swapping(row, old, new):
    """A fake kernel: the reference, with ``old`` replaced by ``new`` in row ``row``."""

    def impl(logits, bias, k, **kwargs):
        _, ids = OPS["route_topk"].reference(logits, bias, k, **kwargs)
        ids = ids.clone()
        ids[row][ids[row] == old] = new
        weights = OPS["route_hash"].reference(logits, ids, **kwargs)
        return weights, ids

    return impl


def test_a_near_tie_broken_the_other_way_passes():
    case = _route_case()
    args, kwargs = _inputs(case)
    args, kth, next_ = _plant_near_tie(args, kwargs, row=2, case=case, gap_in_eps=0.5)
    case = dataclasses.replace(case, make_inputs=lambda g, d: (args, kwargs))
    check_case(_swapping(2, kth, next_), case, "cpu")


def test_a_clear_choice_swapped_fails():
    case = _route_case()
    args, kwargs = _inputs(case)
    args, kth, next_ = _plant_near_tie(args, kwargs, row=2, case=case, gap_in_eps=4.0)
    case = dataclasses.replace(case, make_inputs=lambda g, d: (args, kwargs))
    with pytest.raises(AssertionError, match="leaves out a score"):
        check_case(_swapping(2, kth, next_), case, "cpu")


def test_wrong_weights_fail_on_every_row():
    case = _route_case()

    def impl(logits, bias, k, **kwargs):
        weights, ids = OPS["route_topk"].reference(logits, bias, k, **kwargs)
        weights = weights.clone()
        weights[-1, 0] *= 1 + 1e-3  # the last row: ambiguous or not, its weights are checked
        return weights, ids

    with pytest.raises(AssertionError, match="weights"):
        check_case(impl, case, "cpu", seed=5)


def test_inputs_that_are_all_near_ties_are_refused():
    case = _route_case()
    args, kwargs = _inputs(case)
    logits, bias, k = args
    flat = (torch.zeros_like(logits), torch.zeros_like(bias), k)
    case = dataclasses.replace(case, make_inputs=lambda g, d: (flat, kwargs))
    with pytest.raises(AssertionError, match="near-tied"):
        check_case(OPS["route_topk"].reference, case, "cpu")


def test_select_topk_accepts_exact_ties_only():
    case = cases_for(["select_topk"], "small")[0]
    args, kwargs = _inputs(case, seed=1)
    scores, seq_rows, q_seq, k = args
    candidates = seq_rows[q_seq]  # each row's candidate values
    visible = torch.isfinite(scores)
    row = int(visible.sum(-1).argmax())
    width = int(visible[row].sum())
    assert width > k
    reference = OPS["select_topk"].reference
    picks = reference(scores, seq_rows, q_seq, k)[row]
    kth = int((candidates[row] == picks[k - 1]).nonzero())
    order = scores[row].argsort(descending=True)
    nxt = int(order[k])  # the best column left out
    tied = scores.clone()
    tied[row, nxt] = tied[row, kth]  # an exact tie at the boundary

    def other_way(s, r, qs, kk):
        out = reference(s, r, qs, kk).clone()
        out[row, k - 1] = r[qs[row], nxt]
        return out

    lists = (seq_rows, q_seq, k)
    exact = dataclasses.replace(case, make_inputs=lambda g, d: ((tied, *lists), kwargs))
    check_case(other_way, exact, "cpu")
    untied = dataclasses.replace(case, make_inputs=lambda g, d: ((scores, *lists), kwargs))
    with pytest.raises(AssertionError, match="beyond exact ties"):
        check_case(other_way, untied, "cpu")
