"""Logit processors run before the grammar mask: penalties, token bans, logit bias.

Host preparation (:func:`prepare_processors`) turns the per-row parameters and the generated
tokens into a few small tensors; device application (:func:`apply_processors`) is a handful of
batched torch ops with no host-device synchronisation. Rows that ask for nothing cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling.params import SamplingParams


@dataclass(frozen=True)
class ProcessorInputs:
    """Host-prepared inputs of the logit processors (``None`` = that processor is off).

    token_counts: ``[B, V]`` float32 occurrences of each token in the row's counted tokens.
    presence, frequency, repetition: ``[B, 1]`` float32 per-row penalties.
    ban_rows, ban_tokens: ``[N]`` int64 (row, token) pairs set to ``-inf`` (EOS before
    ``min_tokens`` / ``first_n_token_no_eos``, stop tokens before ``min_tokens``).
    bias_rows, bias_tokens, bias_values: ``[M]`` the ``logit_bias`` entries.
    """

    token_counts: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None
    ban_tokens: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


def _token_counts(
    output_token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    lengths = [len(t) for t in output_token_ids]
    width = max(lengths, default=0)
    padded = torch.full((len(lengths), width + 1), vocab, dtype=torch.int64)
    for row, tokens in enumerate(output_token_ids):
        if tokens:
            padded[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int64)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(lengths), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]  # column ``vocab`` collected the padding


def _bans(params: Sequence[SamplingParams], output_token_ids, vocab: int):
    rows, tokens = [], []
    for row, p in enumerate(params):
        if not p.has_bans:
            continue
        generated = len(output_token_ids[row]) if output_token_ids is not None else 0
        banned = set()
        eos_banned = generated < max(p.min_tokens, p.first_n_token_no_eos)
        if p.eos_token_id is not None and not p.ignore_eos and eos_banned:
            banned.add(p.eos_token_id)
        if generated < p.min_tokens:
            banned.update(p.stop_token_ids)
        for t in sorted(banned):
            if t < vocab:
                rows.append(row)
                tokens.append(t)
    return rows, tokens


def _bias(params: Sequence[SamplingParams], vocab: int):
    rows, tokens, values = [], [], []
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue
        for token, bias in p.logit_bias.items():
            if token >= vocab:
                raise ValueError(
                    f"SamplingParams.logit_bias: token id {token} (row {row}) is outside the "
                    f"vocabulary of {vocab}"
                )
            rows.append(row)
            tokens.append(token)
            values.append(float(bias))
    return rows, tokens, values


def prepare_processors(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None,
    vocab: int,
    device: torch.device,
) -> ProcessorInputs:
    """Build the processors' inputs on ``device`` (host work plus non-blocking copies)."""

    def put(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    fields: dict[str, torch.Tensor] = {}
    if any(p.has_penalty for p in params):
        if output_token_ids is None:
            raise ValueError("sample: penalties were asked for but output_token_ids is None")
        fields["token_counts"] = _token_counts(output_token_ids, vocab, device)
        fields["presence"] = put([[p.presence_penalty] for p in params], torch.float32)
        fields["frequency"] = put([[p.frequency_penalty] for p in params], torch.float32)
        fields["repetition"] = put([[p.repetition_penalty] for p in params], torch.float32)
    ban_rows, ban_tokens = _bans(params, output_token_ids, vocab)
    if ban_rows:
        fields["ban_rows"] = put(ban_rows, torch.int64)
        fields["ban_tokens"] = put(ban_tokens, torch.int64)
    bias_rows, bias_tokens, bias_values = _bias(params, vocab)
    if bias_rows:
        fields["bias_rows"] = put(bias_rows, torch.int64)
        fields["bias_tokens"] = put(bias_tokens, torch.int64)
        fields["bias_values"] = put(bias_values, torch.float32)
    return ProcessorInputs(**fields)


def needs_processing(inputs: ProcessorInputs) -> bool:
    return any(t is not None for t in (inputs.token_counts, inputs.ban_rows, inputs.bias_rows))


def apply_penalties(logits: torch.Tensor, inputs: ProcessorInputs) -> None:
    """Repetition (divide positive / multiply negative logits of seen tokens), then frequency
    (``- f * count``) and presence (``- p * [count > 0]``); in place on float32 ``[B, V]``."""
    if inputs.token_counts is None:
        return
    seen = inputs.token_counts > 0
    rep = inputs.repetition
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(inputs.frequency * inputs.token_counts + inputs.presence * seen.float())


def apply_bans_and_bias(logits: torch.Tensor, inputs: ProcessorInputs) -> None:
    """Token bans (``-inf``) then ``logit_bias`` (added); in place."""
    if inputs.ban_rows is not None:
        logits[inputs.ban_rows, inputs.ban_tokens] = float("-inf")
    if inputs.bias_rows is not None:
        logits.index_put_(
            (inputs.bias_rows, inputs.bias_tokens), inputs.bias_values, accumulate=True
        )


__all__ = [
    "ProcessorInputs",
    "apply_bans_and_bias",
    "apply_penalties",
    "needs_processing",
    "prepare_processors",
]
