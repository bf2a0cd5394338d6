"""Turning ``LLM.generate`` arguments into per-request token ids and sampling parameters."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from deepinfer.engine.frontend.validation import InvalidRequestError
from deepinfer.sampling import SamplingParams

_SEED_MASK = (1 << 63) - 1


def _as_token_list(value: Any) -> list[int] | None:
    """``value`` as a list of Python ints (numpy / torch integer scalars accepted), or None."""
    if type(value) is list and set(map(type, value)) <= {int}:
        return list(value)  # the common case, without a check per token through the ABCs
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    ids = []
    for token in value:
        if isinstance(token, (bool, Iterable)):
            return None
        try:
            ids.append(operator.index(token))
        except TypeError:
            return None
    return ids


def _token_lists(prompt_token_ids: Any) -> list[list[int]]:
    single = _as_token_list(prompt_token_ids)
    if single is not None:
        return [single]
    if isinstance(prompt_token_ids, Iterable) and not isinstance(prompt_token_ids, str):
        lists = []
        for index, ids in enumerate(prompt_token_ids):
            token_list = _as_token_list(ids)
            if token_list is None:
                raise InvalidRequestError(
                    f"request {index}: prompt_token_ids is {ids!r}, expected a list of integers"
                )
            lists.append(token_list)
        return lists
    raise InvalidRequestError(
        f"prompt_token_ids={prompt_token_ids!r}: expected a list of integers or a list of them"
    )


def _texts(prompts: Any) -> list[str]:
    texts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(texts, Sequence):
        raise InvalidRequestError(f"prompts={prompts!r}: expected a string or a list of strings")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidRequestError(f"request {index}: the prompt is {text!r}, expected a string")
        if not text:
            raise InvalidRequestError(f"request {index}: the prompt is empty")
    return list(texts)


def normalize_prompts(
    prompts: Any, prompt_token_ids: Any, tokenizer: Any
) -> tuple[list[str | None], list[list[int]]]:
    """(texts or None per request, token ids per request) from ``generate``'s arguments."""
    if prompts is None and prompt_token_ids is None:
        raise InvalidRequestError("give prompts or prompt_token_ids (both are None)")
    texts = _texts(prompts) if prompts is not None else None
    if prompt_token_ids is not None:
        token_ids = _token_lists(prompt_token_ids)
        if texts is not None and len(texts) != len(token_ids):
            raise InvalidRequestError(
                f"{len(texts)} prompts but {len(token_ids)} prompt_token_ids lists"
            )
        return (texts or [None] * len(token_ids)), token_ids
    if tokenizer is None:
        raise InvalidRequestError("text prompts need a tokenizer; give prompt_token_ids")
    assert texts is not None
    return list(texts), [tokenizer.encode(text) for text in texts]


def normalize_params(sampling_params: Any, num_requests: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per request (None = defaults; one given = shared by all)."""
    if sampling_params is None:
        return [SamplingParams()] * num_requests
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_requests
    params = list(sampling_params)
    if len(params) != num_requests:
        raise InvalidRequestError(
            f"{num_requests} prompts but {len(params)} sampling parameters; give one for all "
            "or one per prompt"
        )
    for index, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise InvalidRequestError(
                f"request {index}: sampling_params is {p!r}, expected a SamplingParams"
            )
    return params


def seed_stream(seed: int) -> Iterator[int]:
    """Per-request seeds for requests that set none: a reproducible stream from ``seed``."""
    import random

    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63) & _SEED_MASK
