"""Processed distributions for speculative decoding: the exact distribution the sampler draws
from, as probabilities (rejection sampling needs ``p(x)`` and ``q(x)``, not only a draw).

:func:`processed_probs` follows :mod:`deepinfer.sampling.sampler` step by step: penalties and
bans, logit bias, grammar mask, temperature, the top-k / top-p / min-p cutoff (the same op, so
the same kept set), softmax. A row sampled by :func:`deepinfer.sampling.sample` with the same
inputs draws from exactly this distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer import kernels
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.processors import (
    apply_bans_and_bias,
    apply_penalties,
    needs_processing,
    prepare_processors,
)


def processed_probs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, V]`` float32 probabilities of the processed distribution of each row.

    logits ``[N, V]`` (not modified); params: one per row, non-greedy (temperature > 0);
    histories: per row the generated tokens the penalties and ``min_tokens`` count; bitmask
    ``[N, ceil(V/32)]`` int32 (xgrammar layout) or None.
    """
    device = logits.device
    work = logits.to(torch.float32, copy=True)
    inputs = prepare_processors(params, histories, logits.shape[1], device)
    if needs_processing(inputs):
        apply_penalties(work, inputs)
        apply_bans_and_bias(work, inputs)
    if bitmask is not None:
        kernels.apply_token_bitmask(work, bitmask.to(device), out=work)
    temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    temperature, top_k, top_p, min_p = (t.to(device) for t in (temperature, top_k, top_p, min_p))
    cutoff = kernels.top_k_top_p_min_p_cutoff(work, temperature, top_k, top_p, min_p)
    scaled = work * (1.0 / temperature)[:, None]
    truncated = scaled.masked_fill(scaled < cutoff[:, None], float("-inf"))
    return torch.softmax(truncated, dim=-1)
