"""The step-cost curve confidence-scheduled verification plans with, measured at start-up.

Dummy steps of ``T`` tokens laid out as verification would lay them out (sequences of
``K + 1`` rows each, on a scratch cache), for ``T`` = 1, 2, 4, ... up to the largest step
verification can make (every running sequence verifying ``K`` drafts, within the token
budget). Timed warm: every size runs twice first (kernel compilation and autotuning happen
there, not in the timings), then the median of a few runs per size.
``StepCostCurve.from_samples`` makes the medians non-decreasing. The drafter's own cost does
not depend on how many drafts are verified, so it is left out (the planner's ``fixed_cost`` is
0). :func:`step_cost_curve` measures once per GPU, model and configuration and keeps the
curve on disk (:mod:`.cost_cache`).
"""

from __future__ import annotations

import hashlib
import time

import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.runner.cost_cache import cached_step_cost_curve, curve_key
from deepinfer.engine.version import __version__
from deepinfer.kernels import envs
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
    runs: int = 5,
) -> StepCostCurve:
    """Milliseconds per target step as a function of its token count (see the module doc)."""
    width = num_draft_tokens + 1
    max_seqs = -(-max_tokens // width)
    blocks_per_seq = -(-width // block_size)
    layout = CacheLayout(
        max_seqs * blocks_per_seq + 1, max_seqs + 1, block_size, max_draft=num_draft_tokens
    )
    cache = ModelCache(model.config, layout, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    batches = {
        t: _dummy_batch(vocab, t, width, blocks_per_seq, device) for t in profile_sizes(max_tokens)
    }
    for _ in range(2):  # warm every size before timing any
        for batch in batches.values():
            _time_step(model, batch, cache, device)
    samples = {
        tokens: [_time_step(model, batch, cache, device) for _ in range(runs)]
        for tokens, batch in batches.items()
    }
    return StepCostCurve.from_samples(samples)


def step_cost_curve(
    model: torch.nn.Module,
    *,
    num_draft_tokens: int,
    max_tokens: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> StepCostCurve:
    """:func:`measure_step_cost_curve`, or the curve an earlier run measured with the same
    device, model and configuration (``DEEPINFER_REMEASURE_STEP_COST=1`` measures again)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    config = hashlib.sha256(repr(model.config).encode()).hexdigest()[:16]
    key = curve_key(
        device=name, model=config, dtype=dtype, drafts=num_draft_tokens, max_tokens=max_tokens,
        block_size=block_size, batch_invariant=envs.batch_invariant(),
        version=__version__,
    )  # fmt: skip
    settings = dict(num_draft_tokens=num_draft_tokens, max_tokens=max_tokens,
                    block_size=block_size, dtype=dtype, device=device)  # fmt: skip
    return cached_step_cost_curve(key, lambda: measure_step_cost_curve(model, **settings))


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
