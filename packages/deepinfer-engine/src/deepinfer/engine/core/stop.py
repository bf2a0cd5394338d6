"""Stop checks run after each generated token (``Scheduler.update``).

Order for one new token: EOS and ``stop_token_ids`` (the token stays in ``token_ids``, its
text is not added), then ``stop`` strings, then the length limits. The first ``min_tokens``
generated tokens never stop the sequence (only the length limits do); EOS does not stop it
within the first ``first_n_token_no_eos`` tokens (the sampler masks it there). A stop string is looked for in the text including the part before the new delta, so
one spanning several tokens or split across detokenisation steps is found; the text is cut
at the start of the match (kept when ``include_stop_str_in_output``).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.core.request import FINISH_LENGTH, FINISH_STOP, Request


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str
    stop_reason: str | int | None = None


def is_token_stop(request: Request, token_id: int) -> StopDecision | None:
    """EOS / ``stop_token_ids`` decision for ``token_id`` (just appended to ``request``)."""
    cond = request.stop_conditions
    num_output = request.num_output_tokens
    if num_output <= cond.min_tokens:
        return None
    if token_id in cond.stop_token_ids:
        return StopDecision(FINISH_STOP, token_id)
    is_eos = token_id in request.eos_token_ids
    if is_eos and not cond.ignore_eos and num_output > cond.first_n_token_no_eos:
        return StopDecision(FINISH_STOP, None)
    return None


def find_stop_string(request: Request, previous_text_len: int) -> tuple[str, int] | None:
    """The earliest stop string ending in the new text, with its start index, or None.

    Only the text from ``max(len(stop)) - 1`` characters before the new text is searched.
    """
    cond = request.stop_conditions
    if not cond.stop or request.num_output_tokens <= cond.min_tokens:
        return None
    region_start = max(0, previous_text_len - cond.max_stop_len + 1)
    region = request.text.tail(request.text.length - region_start)
    best: tuple[str, int] | None = None
    for stop in cond.stop:
        found = region.find(stop, max(0, previous_text_len - len(stop) + 1) - region_start)
        if found != -1 and (best is None or region_start + found < best[1]):
            best = (stop, region_start + found)
    return best


def apply_stop_string(request: Request, previous_text_len: int) -> StopDecision | None:
    """Cut the request's text at a stop string found in the new text, if any."""
    match = find_stop_string(request, previous_text_len)
    if match is None:
        return None
    stop, start = match
    keep = start + len(stop) if request.stop_conditions.include_stop_str_in_output else start
    request.text.truncate(keep)
    return StopDecision(FINISH_STOP, stop)


_LENGTH_STOP = StopDecision(FINISH_LENGTH)


def length_stop(request: Request, max_model_len: int) -> StopDecision | None:
    """``max_tokens`` reached, or the sequence filled ``max_model_len``."""
    num_tokens = len(request.all_token_ids)
    num_output = num_tokens - request.num_prompt_tokens
    if num_output >= request.stop_conditions.max_tokens or num_tokens >= max_model_len:
        return _LENGTH_STOP
    return None


def check_new_token(request: Request, token_id: int, max_model_len: int) -> StopDecision | None:
    """Append ``token_id``'s text to ``request`` and decide whether the sequence stops.

    ``token_id`` must already be in ``request.all_token_ids``. Token stops win over a stop
    string completed by the same token; a stop string wins over the length limits (its text
    cut is what the user asked for). Runs for every generated token: the checks a request
    cannot meet (a token in no stop set, no stop strings) are skipped before any call.
    """
    cond = request.stop_conditions
    if token_id in cond.stop_token_ids or token_id in request.eos_token_ids:
        token_stop = is_token_stop(request, token_id)
        if token_stop is not None:
            return token_stop
    if request.detokenizer is not None:
        previous_text_len = request.text.length
        request.text.append(request.detokenizer.append(token_id))
        if cond.stop:
            string_stop = apply_stop_string(request, previous_text_len)
            if string_stop is not None:
                return string_stop
    return length_stop(request, max_model_len)
