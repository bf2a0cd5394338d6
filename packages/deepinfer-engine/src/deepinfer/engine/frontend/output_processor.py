"""Groups per-sequence updates into ``RequestOutput``s: final ones and streaming deltas.

Streaming holds back the last ``max(len(stop)) - 1`` characters of a running sample's text,
so a stop string that a later token completes is never shown and then taken back. Text is
kept as emitted chunks plus a short held-back tail, so each step costs what it adds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from deepinfer.engine.core.request import StopConditions, num_samples
from deepinfer.engine.core.scheduler_output import SequenceUpdate
from deepinfer.engine.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput

# A streaming delta copies each changed sample per step: built positionally, as
# ``dataclasses.replace`` (which takes 3 us) would, from CompletionOutput's fields in order.
_COMPLETION_FIELDS = (
    "index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason", "error",
    "reasoning_content", "content", "tool_calls",
)  # fmt: skip
if tuple(f.name for f in fields(CompletionOutput)) != _COMPLETION_FIELDS:
    raise ImportError("CompletionOutput's fields changed: update _sample_delta to match")


def _sample_delta(sample: CompletionOutput, text: str, token_ids, logprobs) -> CompletionOutput:
    """``replace(sample, text=text, token_ids=token_ids, logprobs=logprobs)``."""
    return CompletionOutput(
        sample.index,
        text,
        token_ids,
        logprobs,
        sample.finish_reason,
        sample.stop_reason,
        sample.error,
        sample.reasoning_content,
        sample.content,
        sample.tool_calls,
    )


@dataclass
class _SampleText:
    """Emitted text (chunks) and the held-back tail of one sample."""

    emitted: list[str] = field(default_factory=list)
    num_emitted: int = 0
    held_back: str = ""

    def apply(self, new_text: str, text_length: int, holdback: int, finished: bool) -> str:
        """Take one update; return the newly visible text."""
        pending = self.held_back + new_text if self.held_back else new_text
        room = text_length - self.num_emitted
        if len(pending) > room:  # a stop string cut the text
            pending = pending[: max(0, room)]
        if finished or not holdback:
            visible, self.held_back = pending, ""
        else:
            num_visible = max(0, len(pending) - holdback)
            visible, self.held_back = pending[:num_visible], pending[num_visible:]
        if visible:
            self.emitted.append(visible)
            self.num_emitted += len(visible)
        return visible

    def text(self) -> str:
        return "".join(self.emitted) + self.held_back


@dataclass
class _Group:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[CompletionOutput]
    texts: list[_SampleText]
    holdback: int
    metrics: RequestMetrics
    wants_prompt_logprobs: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    streamed_tokens: list[int] = field(default_factory=list)
    num_unfinished: int = 0  # samples without a finish reason (kept by ``OutputProcessor``)

    @property
    def finished(self) -> bool:
        return not self.num_unfinished


def _add_spec_stats(metrics: RequestMetrics, update: SequenceUpdate) -> None:
    metrics.num_verify_steps += update.num_verify_steps
    metrics.num_draft_tokens += update.num_draft_tokens
    metrics.num_accepted_tokens += update.num_accepted_tokens
    if update.draft_confidences is not None:
        if metrics.draft_confidences is None:
            metrics.draft_confidences = []
        metrics.draft_confidences.append(list(update.draft_confidences))


class OutputProcessor:
    """Tracks every request of a run until its output is taken."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._groups: dict[str, _Group] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: Any,
        arrival_time: float,
    ) -> None:
        n = num_samples(params)
        wants_logprobs = getattr(params, "logprobs", None) is not None
        self._groups[request_id] = _Group(
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            samples=[
                CompletionOutput(index=k, logprobs=[] if wants_logprobs else None) for k in range(n)
            ],
            texts=[_SampleText() for _ in range(n)],
            holdback=max(0, StopConditions.from_sampling_params(params).max_stop_len - 1),
            metrics=RequestMetrics(arrival_time, num_prompt_tokens=len(prompt_token_ids)),
            wants_prompt_logprobs=getattr(params, "prompt_logprobs", None) is not None,
            streamed_tokens=[0] * n,
            num_unfinished=n,
        )

    def process(self, updates: list[SequenceUpdate]) -> list[RequestOutput]:
        """Apply updates; return a streaming delta for each request that changed."""
        return [self._delta(gid, per_sample) for gid, per_sample in self.apply(updates).items()]

    def apply(self, updates: list[SequenceUpdate]) -> dict[str, dict[int, str]]:
        """Apply updates without building deltas (callers that only wait for the finished
        outputs); return, per request that changed, each changed sample's new visible text."""
        new_text: dict[str, dict[int, str]] = {}
        now = self.clock()
        groups = self._groups
        for update in updates:
            group_id = update.group_id
            group = groups.get(group_id)
            if group is None:
                continue
            visible = self._apply(group, update, now)
            per_sample = new_text.get(group_id)
            if per_sample is None:
                new_text[group_id] = {update.index: visible}
            else:
                per_sample[update.index] = per_sample.get(update.index, "") + visible
        return new_text

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (its caller no longer waits for it)."""
        self._groups.pop(request_id, None)

    def is_finished(self, request_id: str) -> bool:
        return self._groups[request_id].finished

    def pop_output(self, request_id: str) -> RequestOutput:
        """The whole output of a request; forgets it."""
        group = self._groups.pop(request_id)
        outputs = [replace(s, text=t.text()) for s, t in zip(group.samples, group.texts)]
        return self._output(request_id, group, outputs)

    def _apply(self, group: _Group, update: SequenceUpdate, now: float) -> str:
        index, new_token_ids = update.index, update.new_token_ids
        sample = group.samples[index]
        metrics = group.metrics
        if new_token_ids:
            sample.token_ids.extend(new_token_ids)
            metrics.num_generated_tokens += len(new_token_ids)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        if sample.logprobs is not None:
            sample.logprobs.extend(update.new_logprobs)
        if update.num_verify_steps:
            _add_spec_stats(metrics, update)
        if update.finished:
            was_finished = sample.finish_reason is not None
            sample.finish_reason = update.finish_reason
            sample.stop_reason = update.stop_reason
            sample.error = update.error
            group.num_unfinished += was_finished - (sample.finish_reason is not None)
            metrics.num_preemptions += update.num_preemptions
            if update.prompt_logprobs is not None and group.wants_prompt_logprobs:
                group.prompt_logprobs = [None, *update.prompt_logprobs]
            if group.finished:
                metrics.finished_time = now
        text = group.texts[index]
        return text.apply(update.new_text, update.text_length, group.holdback, update.finished)

    def _delta(self, request_id: str, new_text: dict[int, str]) -> RequestOutput:
        group = self._groups[request_id]
        deltas = []
        for k in sorted(new_text):
            sample = group.samples[k]
            start = group.streamed_tokens[k]
            group.streamed_tokens[k] = len(sample.token_ids)
            logprobs = None if sample.logprobs is None else sample.logprobs[start:]
            deltas.append(_sample_delta(sample, new_text[k], sample.token_ids[start:], logprobs))
        return self._output(request_id, group, deltas)

    @staticmethod
    def _output(request_id: str, group: _Group, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.finished,
            prompt_logprobs=group.prompt_logprobs,
            metrics=group.metrics,
        )
