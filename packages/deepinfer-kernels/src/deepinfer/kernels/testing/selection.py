"""Comparisons for ops that select, so that a conformance test cannot flake on a near-tie.

A kernel and the reference compute the scores a selection ranks with fp32 arithmetic in another
order (or with other ``exp`` / ``log`` implementations). Two candidates whose scores are closer
than that arithmetic's error may rank either way, and with thousands of random rows some row
always has such a pair at the top-k boundary. So a selection is checked in two parts:

- rows whose choice is unambiguous (the k-th and (k+1)-th scores, recomputed the reference's
  way, are more than ``eps`` apart) must choose the reference's set exactly;
- every row's choice must be a top k of the scores modulo ``eps`` (nothing left out scores more
  than ``eps`` above something taken), and the outputs computed from a row's own choice are
  compared, at the case's tolerance, with the reference's outputs for that same choice.

``eps`` comes from the case's own tolerance: the op's contract lets each score-derived output
differ by ``atol + rtol * |value|``, so each of the two scores compared may move that much.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.kernels.registry import OPS


def near_tie_eps(scores: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """``[T, 1]``: how close two of a row's scores may be before their order is ambiguous."""
    finite = scores.masked_fill(~torch.isfinite(scores), 0.0)
    return 2 * (atol + rtol * finite.abs().amax(-1, keepdim=True))


def unambiguous_rows(scores: torch.Tensor, k: int, eps: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the top-``k`` set of each row is decided by more than ``eps``."""
    if k >= scores.shape[-1]:
        return torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
    top = scores.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) > eps[:, 0]


def check_topk_modulo_ties(
    scores: torch.Tensor,
    got_ids: torch.Tensor,
    want_ids: torch.Tensor,
    eps: torch.Tensor,
    label: str,
) -> torch.Tensor:
    """Check the chosen column ids ``[T, k]`` of each row (any order) as the module docstring
    says; returns the unambiguous-row mask. ``scores`` ``[T, C]`` fp32, ``eps`` ``[T, 1]``."""
    rows, k = got_ids.shape
    assert ((got_ids >= 0) & (got_ids < scores.shape[-1])).all(), f"{label}: ids out of range"
    ordered = got_ids.sort(-1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all(), f"{label}: an id chosen twice in a row"
    taken = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, got_ids.long(), True)
    lowest_taken = scores.masked_fill(~taken, float("inf")).amin(-1)
    highest_left = scores.masked_fill(taken, float("-inf")).amax(-1)
    worst = (highest_left - lowest_taken - eps[:, 0]).argmax()
    assert (highest_left <= lowest_taken + eps[:, 0]).all(), (
        f"{label}: row {int(worst)} leaves out a score {float(highest_left[worst])} above a "
        f"taken {float(lowest_taken[worst])} by more than eps {float(eps[worst, 0])}"
    )
    clear = unambiguous_rows(scores, k, eps)
    same = (ordered == want_ids.sort(-1).values).all(-1)
    bad = clear & ~same
    assert not bad.any(), (
        f"{label}: {int(bad.sum())} unambiguous rows chose another set, first row "
        f"{int(bad.nonzero()[0])}"
    )
    return clear


def compare_route_topk(
    got: Any, want: Any, args: tuple[Any, ...], kwargs: dict[str, Any], case: Any, how: str
) -> None:
    """``route_topk``: ids modulo near-ties of ``score + bias``; the weights of every row
    against the reference weights of the kernel's own ids (``route_hash``'s reference)."""
    logits, bias, top_k = args
    got_w, got_ids = (t.cpu() for t in got)
    _, want_ids = (t.cpu() for t in want)
    logits = logits.cpu()
    label = f"{case} ({how})"
    assert got_ids.shape == (logits.shape[0], top_k), f"{label}: ids shape {tuple(got_ids.shape)}"
    assert got_ids.dtype == want_ids.dtype, f"{label}: ids dtype {got_ids.dtype}"
    hash_ref = OPS["route_hash"].reference
    every = torch.arange(logits.shape[-1]).expand(logits.shape[0], -1)
    plain = dict(kwargs, route_scale=1.0, renormalize=False)
    scores = hash_ref(logits, every, **plain)  # the reference's scores of every expert
    chooser = scores if bias is None else scores + bias.cpu().float()
    eps = near_tie_eps(chooser, case.atol, case.rtol)
    clear = check_topk_modulo_ties(chooser, got_ids, want_ids, eps, label)
    assert clear.float().mean() > 0.5, f"{label}: most rows near-tied, inputs test no selection"
    want_w = hash_ref(logits, got_ids, **kwargs)
    torch.testing.assert_close(
        got_w, want_w, atol=case.atol, rtol=case.rtol, msg=lambda m: f"{label} weights: {m}"
    )


def compare_select_topk(
    got: Any, want: Any, args: tuple[Any, ...], kwargs: dict[str, Any], case: Any, how: str
) -> None:
    """``select_topk`` ranks the scores it is given (no arithmetic): the chosen candidates may
    differ from the reference's only among exactly equal scores, in descending score order."""
    scores, seq_rows, q_seq, k = args
    candidates = seq_rows.cpu()[q_seq.cpu().long()]  # [T, C]: each row's candidate values
    scores, got, want = (t.cpu() for t in (scores, got, want))
    label = f"{case} ({how})"
    assert got.shape == want.shape and got.dtype == want.dtype, f"{label}: {got.shape} {got.dtype}"
    assert torch.equal(got < 0, want < 0), f"{label}: padding (-1) differs"
    # each row's candidate values are distinct where visible: map a pick back to its score
    match = (candidates.long().unsqueeze(1) == got.unsqueeze(-1)) & (got >= 0).unsqueeze(-1)
    assert torch.equal(match.sum(-1), (got >= 0).long()), f"{label}: a pick is no candidate"
    picked, wanted = _scores_of(scores, candidates, got), _scores_of(scores, candidates, want)
    assert torch.equal(picked, wanted), f"{label}: picked scores differ beyond exact ties"


def _scores_of(scores: torch.Tensor, candidates: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` the score of each pick (0 for padding)."""
    match = (candidates.long().unsqueeze(1) == picks.unsqueeze(-1)) & (picks >= 0).unsqueeze(-1)
    return (scores.unsqueeze(1) * match).nan_to_num().sum(-1)
