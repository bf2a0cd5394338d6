"""Validation of a batch of inputs at submission, before any work starts.

Every error names the request index, the field and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer.engine.core.request import num_samples


class InvalidRequestError(ValueError):
    """A request of a ``generate``/``chat`` call is invalid (raised before any work)."""


def validate_prompt_token_ids(
    index: int, token_ids: Sequence[int], *, vocab_size: int, max_model_len: int
) -> None:
    """Non-empty, every id in ``[0, vocab_size)``, shorter than ``max_model_len``."""
    if len(token_ids) == 0:
        raise InvalidRequestError(f"request {index}: the prompt is empty")
    in_range = (
        set(map(type, token_ids)) <= {int} and min(token_ids) >= 0 and max(token_ids) < vocab_size
    )
    for position, token_id in enumerate(() if in_range else token_ids):  # finds the bad one
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"request {index}: prompt token {position} is {token_id!r}, expected an "
                f"integer in [0, {vocab_size})"
            )
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"request {index}: the prompt has {len(token_ids)} tokens, expected fewer than "
            f"max_model_len={max_model_len} (at least one position must remain to generate)"
        )


def validate_sampling_params(
    index: int,
    params: Any,
    *,
    vocab_size: int,
    max_num_seqs: int,
    has_tokenizer: bool,
) -> None:
    """Engine-dependent checks (``SamplingParams`` validates its own fields on construction)."""
    n = num_samples(params)
    if not 1 <= n <= max_num_seqs:
        raise InvalidRequestError(
            f"request {index}: n={n}, expected 1 <= n <= max_num_seqs={max_num_seqs}"
        )
    max_tokens = getattr(params, "max_tokens", 16)
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidRequestError(f"request {index}: max_tokens={max_tokens!r}, expected >= 1")
    for token_id in getattr(params, "stop_token_ids", None) or ():
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"request {index}: stop_token_ids contains {token_id!r}, expected integers "
                f"in [0, {vocab_size})"
            )
    if getattr(params, "stop", None) and not has_tokenizer:
        raise InvalidRequestError(
            f"request {index}: stop strings need a tokenizer to detokenise the output, but "
            "the engine has none"
        )


def validate_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    params: Sequence[Any],
    *,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
    has_tokenizer: bool,
) -> None:
    """Validate every request of a batch (raises at the first bad one)."""
    if len(prompt_token_ids) != len(params):
        raise InvalidRequestError(
            f"{len(prompt_token_ids)} prompts but {len(params)} sampling parameters"
        )
    for index, (token_ids, request_params) in enumerate(zip(prompt_token_ids, params)):
        validate_prompt_token_ids(
            index, token_ids, vocab_size=vocab_size, max_model_len=max_model_len
        )
        validate_sampling_params(
            index,
            request_params,
            vocab_size=vocab_size,
            max_num_seqs=max_num_seqs,
            has_tokenizer=has_tokenizer,
        )


def engine_refusal(index: int, params: Any, *, yoco_truncation: str = "off") -> str | None:
    """Why this engine's setting cannot serve request ``index`` (it then fails alone, the other
    requests of the call run), or None. The request itself is valid; another engine could run it."""
    prompt_logprobs = getattr(params, "prompt_logprobs", None)
    if prompt_logprobs is not None and yoco_truncation != "off":
        return (
            f"request {index}: prompt_logprobs={prompt_logprobs} cannot be computed with "
            f"yoco_prefill_truncation_mode={yoco_truncation!r} (the consumer layers skip early "
            "prompt rows); expected prompt_logprobs=None, or the mode 'off'"
        )
    return None
