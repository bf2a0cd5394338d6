"""Sampling and draft verification of one step's sampling rows.

A request samples one row (a decode, or the end of a prefill), ``n`` copies of its last row
(an ``n > 1`` fork, one seed each), or ``1 + d`` rows when it verifies ``d`` drafts: row ``j``
holds ``[last token, drafts]`` up to draft ``j`` and predicts the position of draft ``j``
(row ``d`` the bonus position). Each row is processed as non-speculative decoding would
process that position: penalties over the generated tokens plus drafts ``< j``, the grammar
mask after drafts ``< j`` (the matcher is advanced tentatively and rolled back), the row's own
RNG key (seed, position).

Then per request: ``greedy`` / ``seed_exact`` sample every row with the sampler and accept the
longest prefix of drafts equal to those samples (the rule of ``accept_greedy`` /
``accept_seed_exact``, applied to the sampled tokens the step reads back anyway);
``rejection`` computes the processed target distribution ``p`` of every row and runs
``accept_rejection`` against the kept draft distributions ``q``. A request emits its accepted
drafts plus the final token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from deepinfer.engine.core.scheduler_output import SchedulerOutput, SpecDecodeStats
from deepinfer.engine.runner.async_step import device_index, take_rows
from deepinfer.engine.runner.batch_plan import RunnerSequence, StepPlan
from deepinfer.engine.runner.grammar import GrammarManager
from deepinfer.engine.runner.spec_sampling import processed_probs
from deepinfer.engine.runner.speculation import GREEDY, REJECTION, verify_mode
from deepinfer.sampling import allocate_token_bitmask, sample
from deepinfer.spec import PAD_TOKEN_ID, accept_greedy, accept_rejection, matched_prefix


@dataclass
class RequestRows:
    """One request's sampling rows ``first .. first + count`` (indices into the step's
    sampling rows) and how they are sampled."""

    b: int
    request_id: str
    first: int
    count: int
    drafts: list[int]
    is_fork: bool
    mode: str = GREEDY
    params: list[Any] = field(default_factory=list)
    histories: list[Sequence[int]] = field(default_factory=list)
    masks: torch.Tensor | None = None  # [count, words] int32, None without a grammar


@dataclass
class Emitted:
    """What one request emits this step: tokens, their logprob dicts (or None), the position
    of the row that produced the final token, and its verification stats."""

    request_id: str
    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    final_row_position: int
    stats: SpecDecodeStats | None = None


class Verifier:
    """Samples and verifies a step's rows against what the runner keeps between steps.

    sequences / proposals: the runner's own dicts (its mirror of the scheduler's sequences and
    the drafts' proposals), read, never replaced; grammar: structured outputs, if any;
    acceptance / return_confidences: the speculation settings (``"auto"`` / False without).
    """

    def __init__(
        self,
        sequences: dict[str, RunnerSequence],
        proposals: dict[str, Any],
        grammar: GrammarManager | None,
        *,
        acceptance: str = "auto",
        return_confidences: bool = False,
    ) -> None:
        self.sequences = sequences
        self.proposals = proposals
        self.grammar = grammar
        self.acceptance = acceptance
        self.return_confidences = return_confidences

    def sample_and_verify(
        self, plan: StepPlan, so: SchedulerOutput, logits: torch.Tensor, errors
    ) -> list[Emitted]:
        """Sample / verify every request's rows; ``logits`` ``[S, V]`` are the sampling rows."""
        groups = self.request_rows(plan, so, errors)
        rejecting = [g for g in groups if g.mode == REJECTION and g.drafts]
        matching = [g for g in groups if not (g.mode == REJECTION and g.drafts)]
        emitted = self._match(plan, matching, logits) if matching else []
        if rejecting:
            emitted += self._reject(plan, rejecting, logits)
        return emitted

    def launch_plain(self, plan: StepPlan, so: SchedulerOutput, logits: torch.Tensor, errors):
        """Sample a step without drafts or logprobs and read nothing back: (the request
        groups, the sampled tokens ``[S]`` on the device, None without groups)."""
        groups = self.request_rows(plan, so, errors)
        if not groups:
            return groups, None
        return groups, _sample(plan, groups, logits).token_ids

    def finish_plain(self, plan: StepPlan, groups, tokens: list[int]) -> list[Emitted]:
        """What :meth:`launch_plain`'s groups emit, from the tokens read back."""
        out, at = [], 0
        for g in groups:
            out.append(self._emitted(plan, g, tokens[at : at + g.count], None, 0))
            at += g.count
        return out

    def request_rows(self, plan: StepPlan, so: SchedulerOutput, errors) -> list[RequestRows]:
        """Group the sampling rows by request; requests whose grammar failed are left out."""
        spans: list[list[int]] = []  # [b, first row, row count] per request, in row order
        for s, b in enumerate(plan.sample_requests):
            if spans and spans[-1][0] == b:
                spans[-1][2] += 1
            else:
                spans.append([b, s, 1])
        groups: list[RequestRows] = []
        spec, forks, seeds = so.scheduled_spec_token_ids, so.fork_seeds, plan.sample_seeds
        for b, first, count in spans:
            request_id = plan.request_ids[b]
            if self.grammar is not None and not self.grammar.ready(request_id, errors):
                continue
            seq = self.sequences[request_id]
            params = seq.sampling_params
            num_drafts = plan.num_drafts[b]
            drafts = list(spec.get(request_id, ())[:num_drafts]) if num_drafts else []
            fork = request_id in forks
            if fork:  # one seed per row
                row_params = [_row_params(seq, seeds[first + j]) for j in range(count)]
            else:
                row_params = [_row_params(seq, seeds[first])] * count
            # only penalties and bans read a row's history (the others get one empty, uncopied)
            if params.has_penalty or params.has_bans:
                histories = _histories(seq, drafts, count, fork)
            else:
                histories = [()] * count
            mode = verify_mode(params, seq.has_user_seed, self.acceptance)
            g = RequestRows(b, request_id, first, count, drafts, fork, mode, row_params, histories)
            if self.grammar is not None:
                self._fill_masks(g)
            groups.append(g)
        return groups

    def _fill_masks(self, g: RequestRows) -> None:
        state = self.grammar.state(g.request_id)
        if state is None:
            return
        g.masks = allocate_token_bitmask(g.count, self.grammar.vocab_size)
        if g.is_fork:
            state.fill_bitmask(g.masks, 0)
            g.masks[1:] = g.masks[0]
        else:
            state.fill_draft_bitmasks(g.masks, 0, g.drafts)

    def _match(self, plan, groups, logits) -> list[Emitted]:
        result = _sample(plan, groups, logits)
        host = result.token_ids.tolist()  # the step's one read of its tokens
        params = [p for g in groups for p in g.params]
        logprobs = logprob_dicts(result, params) if result.logprobs is not None else None
        return self.finish_match(plan, groups, host, logprobs)

    def finish_match(self, plan, groups, tokens: list[int], logprobs=None) -> list[Emitted]:
        """What matching groups emit from their rows' tokens (and logprob dicts): a
        request's drafts up to the first that differs from its row's token, then that
        token; a fork every row's token."""
        out, at = [], 0
        for g in groups:
            sampled = tokens[at : at + g.count]
            a = matched_prefix(g.drafts, sampled)
            n = g.count if g.is_fork else a + 1
            lps = logprobs[at : at + n] if logprobs is not None else None
            out.append(self._emitted(plan, g, sampled[:n], lps, a))
            at += g.count
        return out

    def launch_greedy_chain(self, plan: StepPlan, groups: list[RequestRows], logits):
        """Sample and verify plain greedy groups (no forks) on the device, reading nothing
        back: (the rows' tokens ``[S]``, then per group the final token ``[G]`` and the
        position before it ``[G]``, what the drafter's next proposal starts from). The host
        later gets the same outcome from the tokens (:meth:`finish_match`)."""
        tokens = _sample(plan, groups, logits).token_ids
        width = max(len(g.drafts) for g in groups)
        # per group: drafts padded to the width, the token index of each row (the last row
        # repeated past the group's end), the draft count, the first row's position
        packed, at = [], 0
        for g in groups:
            d = len(g.drafts)
            packed += g.drafts + [PAD_TOKEN_ID] * (width - d)
            packed += [at + min(j, g.count - 1) for j in range(width + 1)]
            packed += [d, plan.sample_positions[g.first]]
            at += g.count
        table = device_index(packed, tokens.device).view(len(groups), 2 * width + 3)
        drafts, index = table[:, :width], table[:, width : 2 * width + 1]
        verdict = accept_greedy(drafts, table[:, -2], tokens[index])
        last_positions = table[:, -1] + verdict.num_accepted - 1
        return tokens, verdict.final_tokens, last_positions

    def _reject(self, plan, groups, logits) -> list[Emitted]:
        probs = processed_probs(
            _group_rows(groups, logits),
            [p for g in groups for p in g.params],
            [h for g in groups for h in g.histories],
            _stack_masks(groups, logits.shape[1]),
        )
        vocab, device = probs.shape[1], probs.device
        width = max(len(g.drafts) for g in groups)
        target = torch.zeros(len(groups), width + 1, vocab, device=device)
        draft_probs = torch.zeros(len(groups), width, vocab, device=device)
        drafts = torch.full((len(groups), width), PAD_TOKEN_ID, dtype=torch.long, device=device)
        at = 0
        for k, g in enumerate(groups):
            d = len(g.drafts)
            target[k, : g.count] = probs[at : at + g.count]
            drafts[k, :d] = torch.tensor(g.drafts, device=device)
            draft_probs[k, :d] = self._draft_probs(g, vocab, device)
            at += g.count
        seeds = torch.tensor(
            [g.params[0].seq_seed for g in groups], dtype=torch.long, device=device
        )
        first = [plan.sample_positions[g.first] for g in groups]
        result = accept_rejection(
            drafts,
            torch.tensor([len(g.drafts) for g in groups], device=device),
            draft_probs,
            target,
            seeds,
            torch.tensor(first, dtype=torch.long, device=device),
        )
        accepted = result.num_accepted.tolist()
        outputs = result.output_tokens.tolist()
        out = []
        for k, g in enumerate(groups):
            tokens = outputs[k][: accepted[k] + 1]
            lps = _rejection_logprobs(target[k], tokens, g.params[0].logprobs)
            out.append(self._emitted(plan, g, tokens, lps, accepted[k]))
        return out

    def _draft_probs(self, g: RequestRows, vocab: int, device) -> torch.Tensor:
        """The kept ``q`` rows of the verified drafts; one-hot for a draft source without them."""
        proposal = self.proposals.get(g.request_id)
        d = len(g.drafts)
        if proposal is not None and proposal.probs is not None and len(proposal.probs) >= d:
            return proposal.probs[:d].to(device)
        one_hot = torch.zeros(d, vocab, device=device)
        one_hot[torch.arange(d), torch.tensor(g.drafts, device=device)] = 1.0
        return one_hot

    def _emitted(self, plan, g: RequestRows, tokens, logprobs, accepted: int) -> Emitted:
        final = g.first + (0 if g.is_fork else accepted)
        stats = None
        if g.drafts:
            confidences = None
            if self.return_confidences:
                proposal = self.proposals.get(g.request_id)
                known = proposal.confidences if proposal is not None else []
                confidences = list(known[: len(g.drafts)])
            stats = SpecDecodeStats(len(g.drafts), accepted, confidences)
        has_logprobs = logprobs is not None and any(lp is not None for lp in logprobs)
        return Emitted(
            g.request_id,
            tokens,
            logprobs if has_logprobs else None,
            plan.sample_positions[final] - 1,
            stats,
        )


def _sample(plan: StepPlan, groups: list[RequestRows], logits: torch.Tensor):
    """The sampler over the groups' rows of ``logits``: each row with its parameters,
    position, history and grammar mask."""
    rows = _rows(groups)
    return sample(
        take_rows(logits, rows),
        [p for g in groups for p in g.params],
        _positions(plan, rows, logits),
        output_token_ids=[h for g in groups for h in g.histories],
        bitmask=_stack_masks(groups, logits.shape[1]),
    )


def _stack_masks(groups: list[RequestRows], vocab_size: int) -> torch.Tensor | None:
    if all(g.masks is None for g in groups):
        return None
    rows = sum(g.count for g in groups)
    mask, at = allocate_token_bitmask(rows, vocab_size), 0
    for g in groups:
        if g.masks is not None:
            mask[at : at + g.count] = g.masks
        at += g.count
    return mask


def _group_rows(groups: list[RequestRows], logits: torch.Tensor) -> torch.Tensor:
    """The groups' rows of ``logits``, in group order."""
    return take_rows(logits, _rows(groups))


def _rows(groups: list[RequestRows]) -> list[int]:
    """The groups' sampling rows, in group order."""
    return [g.first + j for g in groups for j in range(g.count)]


def _positions(plan: StepPlan, rows: list[int], logits: torch.Tensor) -> list[int]:
    """The positions ``rows`` sample; the plan's list itself when they are all of its rows (no
    request left out: ``rows`` ascend)."""
    if len(rows) == logits.shape[0] == len(plan.sample_positions) and rows[-1] == len(rows) - 1:
        return plan.sample_positions
    return [plan.sample_positions[r] for r in rows]


def _histories(seq: RunnerSequence, drafts: list[int], count: int, fork: bool):
    """Per row, the tokens its penalties and bans count: the generated ones, then the drafts
    before the row's (a fork's rows all predict the same position)."""
    generated = seq.token_ids[seq.num_prompt_tokens :]
    if fork:
        return [generated] * count
    return [generated + drafts[:j] for j in range(count)]


def _row_params(seq: RunnerSequence, seed: int) -> Any:
    """The sequence's sampling parameters drawn with ``seed``, built once per seed."""
    params = seq.row_params.get(seed)
    if params is None:
        params = seq.row_params[seed] = replace(seq.sampling_params, seq_seed=seed, seed=None)
    return params


def _rejection_logprobs(probs: torch.Tensor, tokens: list[int], num_top: int | None):
    """``{token: logprob}`` plus the top alternatives of the processed target rows."""
    if num_top is None:
        return [None] * len(tokens)
    logp = torch.log(probs[: len(tokens)])
    dicts = []
    for j, token in enumerate(tokens):
        entry = {token: float(logp[j, token])}
        if num_top > 0:
            values, ids = logp[j].topk(num_top)
            for t, v in zip(ids.tolist(), values.tolist()):
                entry.setdefault(t, v)
        dicts.append(entry)
    return dicts


def logprob_dicts(result: Any, params: list[Any]) -> list[dict[int, float] | None]:
    """Per row: ``{sampled token: logprob}`` then the top-k alternatives (processed
    distribution, see :class:`deepinfer.sampling.SampleResult`)."""
    if result.logprobs is None:
        return [None] * len(params)
    sampled = result.token_ids.tolist()
    chosen = result.logprobs.tolist()
    top_ids = result.top_token_ids.tolist()
    top_lp = result.top_logprobs.tolist()
    dicts: list[dict[int, float] | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            dicts.append(None)
            continue
        entry = {sampled[i]: chosen[i]}
        for token, value in zip(top_ids[i][: p.logprobs], top_lp[i][: p.logprobs]):
            entry.setdefault(token, value)
        dicts.append(entry)
    return dicts
