"""User-facing outputs: ``RequestOutput`` with one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One sample of a request.

    text: the generated text (without the matched stop string or stop token).
    token_ids: the generated tokens (including a matched EOS / stop token).
    logprobs: per token ``{token id: logprob}`` (sampled token and top-k), when asked.
    finish_reason: ``"stop" | "length" | "abort" | "error"``, None while running.
    stop_reason: the stop string or stop token id that matched (None for EOS and others).
    error: the message when ``finish_reason == "error"``.
    reasoning_content, content, tool_calls: filled by ``LLM.chat`` from the parsed text.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic`` seconds) and counts of one request (all samples).

    Speculative decoding: ``num_verify_steps`` decode steps verified drafts (each emits the
    accepted drafts plus one final token); ``num_draft_tokens`` drafts were verified and
    ``num_accepted_tokens`` of them accepted and emitted. ``draft_confidences``: per verify
    step, the drafter's confidence of each verified draft (only with
    ``LLM(return_draft_confidences=True)``, else None).
    """

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_confidences: list[list[float]] | None = None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step, the final (bonus) token included; None without
        verify steps."""
        if self.num_verify_steps == 0:
            return None
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The outputs of one request, in sample order.

    prompt_logprobs: None for the first prompt token, then ``{token id: logprob}`` per
    prompt token, when asked. In streaming, ``outputs`` hold only what is new since the
    previous item for that request (text and tokens as deltas).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
