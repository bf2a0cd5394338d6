"""The model runner: the engine core's executor over a real model and its cache.

One step: mirror the scheduler's diffs (:class:`RunnerState`), copy blocks and state slots,
reset the slots of fresh sequences -> (confidence-scheduled verification: trim each request's
drafts) -> lay the step out (:func:`build_step_plan`) -> one forward over the flat batch,
logits only for the rows that sample or need prompt logprobs -> seed the drafter's windows
with the step's taps -> prompt logprobs -> sample and verify (:mod:`.verify`; grammar masks
applied, one row per seed for ``n > 1`` forks) -> propose the next drafts (:mod:`.drafting`)
-> ``ModelRunnerOutput``. A request whose grammar fails finishes alone with an error.

``execute_async`` (asynchronous scheduling) returns once a step without drafts or logprobs is
queued on the device; its sampled tokens are copied back in the background and read by
``result()`` (:mod:`.async_step`), at the latest when the next step starts, whose
``from_previous_sample`` requests take them as input. A speculative step of plain greedy
requests with a greedy draft graph is queued whole the same way (the greedy chain): the
verification's accept counts pick each request's anchor and last position on the device, the
draft graph runs from them, and the step's tokens, drafts and confidences come back in one
read; other speculative steps read the verification back, then draft. ``execute`` is
``execute_async`` then ``result()``.

Rejected draft tokens need no undo: every ring of the state slots (target and draft windows,
compressor partial windows, Engram history) holds ``window + K`` rows addressed by position,
and compressed entries are visible only to positions after them, so what a rejected token
wrote is overwritten by the next step's tokens at the same positions before anything reads
it; the scheduler simply does not count those positions as computed. Grammar matchers are
advanced tentatively over drafts and rolled back.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from deepinfer.engine.core.executor import DoneStep, StepResult
from deepinfer.engine.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    SpecDecodeStats,
)
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.runner.async_step import PendingStep, read_back, sync_guard, take_rows
from deepinfer.engine.runner.batch_plan import RunnerState, StepPlan, build_step_plan
from deepinfer.engine.runner.cache_ops import copy_blocks, copy_slots, reset_slots
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.runner.drafting import DraftRequest, DraftSource, Proposal, draft_params
from deepinfer.engine.runner.grammar import GrammarManager
from deepinfer.engine.runner.images import image_fields
from deepinfer.engine.runner.speculation import GREEDY, SpecConfig, verify_mode
from deepinfer.engine.runner.step_inputs import step_batch
from deepinfer.engine.runner.varlen import trim_verification
from deepinfer.engine.runner.verify import Emitted, Verifier


class ModelRunner:
    """Executor over ``model`` and its :class:`ModelCache` (``grammar``: structured outputs;
    ``spec`` + ``drafter``: speculative decoding; ``graphs``: step CUDA graphs, used for the
    steps they accept when there is no drafter or when they seed it: ``speculative``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: ModelCache,
        *,
        grammar: GrammarManager | None = None,
        spec: SpecConfig | None = None,
        drafter: DraftSource | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        if (spec is None) != (drafter is None):
            raise ValueError("spec and drafter: expected both or neither")
        self.model = model
        self.cache = cache
        self.device = next(iter(cache.tensors.values())).device
        self.grammar = grammar
        self.spec = spec
        self.drafter = drafter
        self.graphs = graphs
        self.state = RunnerState()
        self._pending: PendingStep | None = None
        # this step's fed input rows and tokens (PendingStep.fed_inputs), or None
        self._feed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.proposals: dict[str, Proposal] = {}
        self.verifier = Verifier(
            self.state.sequences,
            self.proposals,
            grammar,
            acceptance=spec.acceptance if spec is not None else "auto",
            return_confidences=spec.return_confidences if spec is not None else False,
        )

    @property
    def num_draft_tokens(self) -> int:
        """Drafts proposed per request per step (0 without speculation)."""
        return self.spec.num_draft_tokens if self.spec is not None else 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so).result()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> StepResult:
        """Queue the step on the device; sampled tokens are read back by ``result()``
        (steps with drafts, logprobs or prompt logprobs read them before returning)."""
        previous, self._feed = self._take_pending(so), None
        out = ModelRunnerOutput()
        self._apply(so, out.errors)
        if previous is not None:  # this step's placeholders wait for its tokens
            previous.hold_placeholders(so.from_previous_sample, self.state.sequences)
        live = {r: n for r, n in so.num_scheduled_tokens.items() if r not in out.errors}
        if not live:
            return DoneStep(out)
        so = replace(so, num_scheduled_tokens=live)
        verifying = {r for r, d in so.scheduled_spec_token_ids.items() if d and r in live}
        if self.spec is not None and self.spec.varlen and self.spec.cost_curve is not None:
            so = trim_verification(so, self.proposals, self.spec.cost_curve)
        plan = build_step_plan(self.state, so)
        rows, sample_at, prompt_at = plan.logits_layout()
        self._feed = previous.fed_inputs(plan, self.device) if previous is not None else None
        if plan.sample_rows and not plan.prompt_logprob_rows and self._defers(plan):
            with sync_guard(self.device, self._replays_graph(plan, rows)):
                logits = self._forward(plan, rows)
                sampled = take_rows(logits, sample_at)
                groups, tokens = self.verifier.launch_plain(plan, so, sampled, out.errors)
                if tokens is not None:
                    rows_of, at = {}, 0
                    for g in groups:
                        if not g.is_fork:
                            rows_of[g.request_id] = at
                        at += g.count
                    placeholders: dict[str, int] = {}
                    finish = partial(self._finish_plain, plan, so, groups, verifying, out,
                                     placeholders)  # fmt: skip
                    self._pending = PendingStep(finish, *read_back(tokens), tokens=tokens,
                                                rows=rows_of)  # fmt: skip
                    self._pending.placeholders = placeholders
                    return self._pending
            return DoneStep(out)
        chain = self._greedy_chain(plan, so, out.errors)
        if chain is not None:
            return self._launch_chain(plan, so, rows, sample_at, chain, verifying, out)
        with sync_guard(self.device, self._replays_graph(plan, rows)):
            logits = self._forward(plan, rows)
        if plan.prompt_logprob_rows:
            self._prompt_logprobs(plan, take_rows(logits, prompt_at), out)
        if plan.sample_rows:
            sampled = take_rows(logits, sample_at)
            emitted = self.verifier.sample_and_verify(plan, so, sampled, out.errors)
            self._record(emitted, so, verifying, out)
            if self.drafter is not None:
                self._propose([e for e in emitted if e.request_id not in so.fork_seeds], out)
        return DoneStep(out)

    def _take_pending(self, so: SchedulerOutput) -> PendingStep | None:
        """The step in flight when this one takes its sampled tokens on the device (returned,
        left in flight: :meth:`PendingStep.feeds`), else None after reading it back."""
        pending, self._pending = self._pending, None
        if pending is None or pending.is_done:
            return None
        if self.drafter is None and pending.feeds(
            so.from_previous_sample, self.state.sequences, self.grammar
        ):
            return pending
        pending.result()
        return None

    def _greedy_chain(self, plan: StepPlan, so: SchedulerOutput, errors):
        """The request groups of a speculative step that runs as one queue of device work
        (:meth:`_launch_chain`), or None: every request plain greedy (no logprobs, grammar or
        logit processing), no fork or prompt logprobs, a greedy draft graph for the batch,
        and every request drafted next whatever it accepts (not within ``K + 1`` tokens of
        ``max_tokens``: which ones are drafted must not depend on the outcome)."""
        drafter = self.drafter
        if drafter is None or not plan.sample_rows or plan.prompt_logprob_rows or so.fork_seeds:
            return None
        chains = getattr(drafter, "chains", None)
        if chains is None or not chains(len(plan.request_ids)):
            return None
        sequences = self.state.sequences
        for request_id in plan.request_ids:
            seq = sequences[request_id]
            if not seq.sampling_params.is_plain_greedy:
                return None
            if self.grammar is not None and self.grammar.has_grammar(request_id):
                return None
        groups = self.verifier.request_rows(plan, so, errors)
        if len(groups) != len(plan.request_ids):
            return None  # a request samples nothing this step (a prefill chunk)
        for g in groups:  # (all of a group's rows emitted: the fewest drafts allowed next)
            if g.mode != GREEDY or self._draft_limit(sequences[g.request_id], g.count) <= 0:
                return None
        return groups

    def _launch_chain(self, plan, so, rows, sample_at, groups, verifying, out) -> StepResult:
        """Verify, pick the next drafts from each request's outcome and draft, all on the
        device; the tokens, drafts and confidences are read back together by ``result()``."""
        slots = [self.state.sequences[g.request_id].state_slot for g in groups]
        with sync_guard(self.device, self._replays_graph(plan, rows)):
            logits = self._forward(plan, rows)
            sampled = take_rows(logits, sample_at)
            tokens, anchors, last_positions = self.verifier.launch_greedy_chain(
                plan, groups, sampled
            )
        drafted = self.drafter.propose_on_device(anchors, last_positions, slots)  # guards its own
        if drafted is None:  # no draft graph after all: propose from the host
            emitted = self.verifier.finish_match(plan, groups, tokens.tolist())
            self._record(emitted, so, verifying, out)
            self._propose(emitted, out)
            return DoneStep(out)
        finish = partial(self._finish_chain, plan, so, groups, verifying, out)
        self._pending = PendingStep(finish, *read_back(tokens, *drafted))
        return self._pending

    def _finish_chain(self, plan, so, groups, verifying, out, tokens, drafts, confidences):
        emitted = self.verifier.finish_match(plan, groups, tokens)
        self._record(emitted, so, verifying, out)
        for b, e in enumerate(emitted):
            self.proposals.pop(e.request_id, None)
            limit = self._draft_limit(self.state.sequences[e.request_id], len(e.tokens))
            if limit > 0:
                self.proposals[e.request_id] = Proposal(drafts[b][:limit], confidences[b][:limit])
                out.draft_token_ids[e.request_id] = drafts[b][:limit]
        return out

    def _replays_graph(self, plan: StepPlan, rows: list[int]) -> bool:
        """Whether the step replays an already captured decode graph (no capture, no eager
        input copies: ``DEEPINFER_SYNC_GUARD`` checks such steps)."""
        if not self._takes_graphs(plan):
            return False
        entry = self.graphs.graphs.get(self.graphs.key(plan, rows))
        return entry is not None and entry.graph is not None

    def _takes_graphs(self, plan: StepPlan) -> bool:
        if self.graphs is None or plan.images:
            return False
        return self.drafter is None or self.graphs.speculative

    def _defers(self, plan: StepPlan) -> bool:
        """Whether the step's tokens can be read back later: no drafts, no logprobs."""
        if self.drafter is not None:
            return False
        return all(p.logprobs is None for p in plan.sample_params(self.state))

    def _finish_plain(self, plan, so, groups, verifying, out, placeholders, tokens: list[int]):
        emitted = self.verifier.finish_plain(plan, groups, tokens)
        self._record(emitted, so, verifying, out, placeholders)
        return out

    def _record(self, emitted: list[Emitted], so, verifying: set[str], out,
                placeholders: dict[str, int] | None = None) -> None:  # fmt: skip
        self._emit(emitted, verifying, out)
        for e in emitted:  # the input of a from_previous_sample request next step
            seq = self.state.sequences.get(e.request_id)
            if seq is None:  # finished since (a step read back after the next one started)
                continue
            newest = e.tokens[0] if e.request_id in so.fork_seeds else e.tokens[-1]
            self.state.last_sampled[e.request_id] = newest
            at = placeholders.pop(e.request_id, None) if placeholders else None
            if at is not None:  # a later step took it as input on the device
                seq.token_ids[at] = newest

    def _forward(self, plan: StepPlan, rows: list[int]) -> torch.Tensor:
        """Logits of ``rows``: a step graph's replay when one takes the step (with a drafter,
        graphs that seed it), else eager."""
        if self._takes_graphs(plan):
            logits = self.graphs.run(plan, rows, self._feed)
            if logits is not None:
                return logits
        batch = self._batch(plan, rows)
        if self.drafter is not None:
            step = self.model.forward_step(batch, self.cache)
            self.drafter.seed(step, batch)
            return step.logits
        return self.model(batch, self.cache)  # writes KV even if no logits

    def _apply(self, so: SchedulerOutput, errors: dict[str, str]) -> None:
        sequences = self.state.sequences
        before = {
            r: len(sequences[r].token_ids) for r in (c.request_id for c in so.cached_requests)
        }
        self.state.apply(so)
        copy_blocks(self.cache, so.block_copies)
        copy_slots(self.cache, so.state_copies)
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.proposals.pop(request_id, None)
            if self.grammar is not None:
                self.grammar.forget(request_id)
        # new sequences start from clean state slots
        fresh = [new.state_slot for new in so.new_requests if new.num_computed_tokens == 0]
        reset_slots(self.cache, fresh)
        for new in so.new_requests:
            self.proposals.pop(new.request_id, None)
            if self.grammar is not None:
                seq = sequences[new.request_id]
                generated = seq.token_ids[seq.num_prompt_tokens :]
                self.grammar.start(new.request_id, seq.sampling_params, generated, errors)
        if self.grammar is not None:
            for request_id, old_len in before.items():
                new_tokens = sequences[request_id].token_ids[old_len:]
                self.grammar.advance(request_id, new_tokens, errors)

    def _batch(self, plan: StepPlan, rows: list[int]) -> ForwardBatch:
        """The step's eager inputs (the fed tokens written over the plan's)."""
        lengths = [len(self.state.sequences[r].token_ids) for r in plan.request_ids]
        batch = step_batch(
            plan, rows, self.device, **image_fields(self.model, plan.images, self.device),
            prompt_lens=lengths,
        )  # fmt: skip
        if self._feed is not None:
            batch.input_ids.index_copy_(0, *self._feed)
        return batch

    def _prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor, out: ModelRunnerOutput):
        """``{prompt token: logprob}`` plus the top-k alternatives, per prompt position."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(plan.prompt_logprob_targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        wanted = [
            self.state.sequences[plan.request_ids[b]].sampling_params.prompt_logprobs
            for b in plan.prompt_logprob_requests
        ]
        top = logprobs.topk(max(wanted), dim=-1) if max(wanted) > 0 else None
        for s, b in enumerate(plan.prompt_logprob_requests):
            entry = {plan.prompt_logprob_targets[s]: chosen[s]}
            if top is not None:
                k = wanted[s]
                entry.update(zip(top.indices[s, :k].tolist(), top.values[s, :k].tolist()))
            out.prompt_logprobs.setdefault(plan.request_ids[b], []).append(entry)

    def _emit(self, emitted: list[Emitted], verifying: set[str], out: ModelRunnerOutput) -> None:
        """Record the step's tokens; a request that had drafts scheduled counts a verify step
        even when confidence scheduling verified none of them."""
        for e in emitted:
            out.sampled_token_ids[e.request_id] = list(e.tokens)
            if e.logprobs is not None:
                out.logprobs[e.request_id] = list(e.logprobs)
            if e.stats is not None:
                out.spec_stats[e.request_id] = e.stats
            elif e.request_id in verifying:
                confidences = [] if self.spec.return_confidences else None
                out.spec_stats[e.request_id] = SpecDecodeStats(0, 0, confidences)

    def _propose(self, emitted: list[Emitted], out: ModelRunnerOutput) -> None:
        """Draft after each request's newest token (at most the tokens it may still emit)."""
        requests = [r for r in (self._draft_request(e) for e in emitted) if r is not None]
        for e in emitted:
            self.proposals.pop(e.request_id, None)
        for request_id, proposal in self.drafter.propose(requests).items():
            if proposal.tokens:
                self.proposals[request_id] = proposal
                out.draft_token_ids[request_id] = list(proposal.tokens)

    def _draft_limit(self, seq, num_emitted: int) -> int:
        """Drafts a request may take after emitting ``num_emitted`` tokens this step: at most
        ``K``, and the next verify step emits drafts + 1 tokens, no more than ``max_tokens``
        allows (<= 0: none)."""
        num_generated = len(seq.token_ids) - seq.num_prompt_tokens + num_emitted
        return min(self.spec.num_draft_tokens, seq.sampling_params.max_tokens - num_generated - 1)

    def _draft_request(self, e: Emitted) -> DraftRequest | None:
        seq = self.state.sequences[e.request_id]
        params = seq.sampling_params
        max_drafts = self._draft_limit(seq, len(e.tokens))
        grammar = self.grammar.state(e.request_id) if self.grammar is not None else None
        if grammar is not None:  # the matcher rolls back this step's tokens and the drafts
            max_drafts = min(max_drafts, grammar.max_rollback_tokens - len(e.tokens))
        if max_drafts <= 0:
            return None
        # only penalties and bans read the history (no copy of the sequence for the others)
        counted = params.has_penalty or params.has_bans
        return DraftRequest(
            request_id=e.request_id,
            anchor=e.tokens[-1],
            last_position=e.final_row_position,
            slot=seq.state_slot,
            params=draft_params(seq),
            mode=verify_mode(params, seq.has_user_seed, self.spec.acceptance),
            history=seq.token_ids[seq.num_prompt_tokens :] + e.tokens if counted else [],
            max_drafts=max_drafts,
            grammar=grammar,
            pending_tokens=list(e.tokens),
        )
