"""The step-cost curve confidence-scheduled verification plans with, measured at start-up.

Dummy steps of ``T`` tokens laid out as verification would lay them out (sequences of
``K + 1`` rows each, on a scratch cache), timed after one warm-up, median of a few runs per
size, for ``T`` = 1, 2, 4, ... up to the largest step verification can make (every running
sequence verifying ``K`` drafts, within the token budget). ``StepCostCurve.from_samples`` makes
the medians non-decreasing. The drafter's own cost does not depend on how many drafts are
verified, so it is left out (the planner's ``fixed_cost`` is 0).
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.spec import StepCostCurve


def profile_sizes(max_tokens: int) -> list[int]:
    """Powers of two below ``max_tokens``, then ``max_tokens`` itself."""
    sizes, t = [], 1
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]


def measure_step_cost_curve(
    model: torch.nn.Module,
    *,
    num_draft_tokens: int,
    max_tokens: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    runs: int = 3,
) -> StepCostCurve:
    """Milliseconds per target step as a function of its token count (see the module doc)."""
    width = num_draft_tokens + 1
    max_seqs = -(-max_tokens // width)
    blocks_per_seq = -(-width // block_size)
    layout = CacheLayout(
        max_seqs * blocks_per_seq + 1, max_seqs + 1, block_size, max_draft=num_draft_tokens
    )
    cache = ModelCache(model.config, layout, dtype=dtype, device=device)
    samples = {}
    for tokens in profile_sizes(max_tokens):
        batch = _dummy_batch(model.config.vocab_size, tokens, width, blocks_per_seq, device)
        _time_step(model, batch, cache, device)  # warm-up
        samples[tokens] = [_time_step(model, batch, cache, device) for _ in range(runs)]
    return StepCostCurve.from_samples(samples)


def _dummy_batch(vocab: int, tokens: int, width: int, blocks_per_seq: int, device):
    lengths = [width] * (tokens // width) + ([tokens % width] if tokens % width else [])
    n = len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(k) for k in lengths])
    tables = torch.arange(1, n * blocks_per_seq + 1, dtype=torch.int32).view(n, blocks_per_seq)
    gen = torch.Generator().manual_seed(tokens)
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (tokens,), generator=gen).to(device),
        positions=positions.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(lengths).to(device),
        block_tables=tables.to(device),
        state_slots=torch.arange(1, n + 1).to(device),
        logits_indices=torch.arange(tokens).to(device),
    )


@torch.inference_mode()
def _time_step(model, batch: ForwardBatch, cache: ModelCache, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model(batch, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3
