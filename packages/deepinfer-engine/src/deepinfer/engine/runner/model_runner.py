"""The model runner: the engine core's executor over a real model and its cache.

One step: mirror the scheduler's diffs (:class:`RunnerState`), copy blocks and state slots,
reset the slots of fresh sequences -> lay the step out (:func:`build_step_plan`) -> one forward
over the flat batch, logits only for the rows that sample or need prompt logprobs -> prompt
logprobs -> sample (grammar masks applied, one row per seed for ``n > 1`` forks) ->
``ModelRunnerOutput``. A request whose grammar fails finishes alone with an error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from deepinfer.engine.core.batch_plan import RunnerState, StepPlan, build_step_plan
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.runner.cache_ops import copy_blocks, copy_slots, reset_slot
from deepinfer.engine.runner.grammar import GrammarManager
from deepinfer.sampling import sample


class ModelRunner:
    """Executor over ``model`` and its :class:`ModelCache` (``grammar``: structured outputs)."""

    def __init__(
        self, model: torch.nn.Module, cache: ModelCache, *, grammar: GrammarManager | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = next(iter(cache.tensors.values())).device
        self.grammar = grammar
        self.state = RunnerState()

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        self._apply(so, out.errors)
        live = {r: n for r, n in so.num_scheduled_tokens.items() if r not in out.errors}
        if not live:
            return out
        plan = build_step_plan(self.state, replace(so, num_scheduled_tokens=live))
        rows, sample_at, prompt_at = plan.logits_layout()
        logits = self.model(self._batch(plan, rows), self.cache)  # writes KV even if no logits
        if plan.prompt_logprob_rows:
            self._prompt_logprobs(plan, logits[prompt_at], out)
        if plan.sample_rows:
            self._sample(plan, logits[sample_at], out)
        return out

    def _apply(self, so: SchedulerOutput, errors: dict[str, str]) -> None:
        sequences = self.state.sequences
        before = {
            r: len(sequences[r].token_ids) for r in (c.request_id for c in so.cached_requests)
        }
        self.state.apply(so)
        copy_blocks(self.cache, so.block_copies)
        copy_slots(self.cache, so.state_copies)
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            if self.grammar is not None:
                self.grammar.forget(request_id)
        for new in so.new_requests:
            if new.num_computed_tokens == 0:
                reset_slot(self.cache, new.state_slot)
            if self.grammar is not None:
                seq = sequences[new.request_id]
                generated = seq.token_ids[seq.num_prompt_tokens :]
                self.grammar.start(new.request_id, seq.sampling_params, generated, errors)
        if self.grammar is not None:
            for request_id, old_len in before.items():
                new_tokens = sequences[request_id].token_ids[old_len:]
                self.grammar.advance(request_id, new_tokens, errors)

    def _batch(self, plan: StepPlan, rows: list[int]) -> ForwardBatch:
        long = dict(dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=torch.tensor(plan.input_ids, **long),
            positions=torch.tensor(plan.positions, **long),
            cu_seqlens_q=torch.tensor(plan.cu_seqlens_q, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(plan.seq_lens, **long),
            block_tables=torch.tensor(plan.block_tables, dtype=torch.int32, device=self.device),
            state_slots=torch.tensor(plan.state_slots, **long),
            logits_indices=torch.tensor(rows, **long),
        )

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

    def _sample(self, plan: StepPlan, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        keep, params, histories, masks = [], [], [], []
        for s, b in enumerate(plan.sample_requests):
            request_id = plan.request_ids[b]
            seq = self.state.sequences[request_id]
            if self.grammar is not None and not self.grammar.ready(request_id, out.errors):
                continue
            keep.append(s)
            params.append(replace(seq.sampling_params, seq_seed=plan.sample_seeds[s], seed=None))
            histories.append(seq.token_ids[seq.num_prompt_tokens :])
            masks.append(self.grammar.bitmask_row(request_id) if self.grammar else None)
        if not keep:
            return
        bitmask = self.grammar.stack(masks) if any(m is not None for m in masks) else None
        positions = [plan.sample_positions[s] for s in keep]
        result = sample(
            logits[keep], params, positions, output_token_ids=histories, bitmask=bitmask
        )
        tokens = result.token_ids.tolist()
        logprobs = _logprob_dicts(result, params)
        for i, s in enumerate(keep):
            request_id = plan.request_ids[plan.sample_requests[s]]
            out.sampled_token_ids.setdefault(request_id, []).append(tokens[i])
            if logprobs[i] is not None:
                out.logprobs.setdefault(request_id, []).append(logprobs[i])


def _logprob_dicts(result: Any, params: list[Any]) -> list[dict[int, float] | None]:
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
