"""The step-cost curve confidence-scheduled verification plans with, measured at start-up.

Dummy verification steps of ``T`` tokens (sequences of ``K + 1`` rows each) for ``T`` = 1, 2,
4, ... up to the largest step verification can make (every running sequence verifying ``K``
drafts, within the token budget), run the way the runner runs them: with step graphs
(``graphs``, the runner's :class:`DecodeGraphs` over its own cache, before any request holds a
block or slot), each size replays its graph, captured on its first run; a size the graphs do
not take, and every size without graphs, runs the eager forward. Timed warm: every size runs
twice first (capture, kernel compilation and autotuning happen there, not in the timings),
then the median of a few runs per size, each from the host's launch to the device's end.
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
from deepinfer.engine.runner.batch_plan import StepPlan
from deepinfer.engine.runner.cost_cache import cached_step_cost_curve, curve_key
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.runner.step_inputs import step_batch
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
    graphs: DecodeGraphs | None = None,
    runs: int = 5,
) -> StepCostCurve:
    """Milliseconds per target step as a function of its token count (see the module doc)."""
    width = num_draft_tokens + 1
    blocks_per_seq = -(-width // block_size)
    if graphs is not None:  # the runner's cache: the steps write where its graphs read
        cache = graphs.cache
    else:
        max_seqs = -(-max_tokens // width)
        layout = CacheLayout(max_seqs * blocks_per_seq + 1, max_seqs + 1, block_size,
                             max_draft=num_draft_tokens)  # fmt: skip
        cache = ModelCache(model.config, layout, dtype=dtype, device=device)
    plans = {
        t: dummy_verify_plan(model.config.vocab_size, t, width, blocks_per_seq, cache.layout)
        for t in profile_sizes(max_tokens)
    }
    for _ in range(2):  # warm every size (graphs captured) before timing any
        for plan in plans.values():
            _time_step(model, plan, cache, graphs, device)
    samples = {
        tokens: [_time_step(model, plan, cache, graphs, device) for _ in range(runs)]
        for tokens, plan in plans.items()
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
    graphs: DecodeGraphs | None = None,
    remeasure: bool = False,
) -> StepCostCurve:
    """:func:`measure_step_cost_curve`, or the curve an earlier run measured with the same
    device, model and configuration (``remeasure`` or ``DEEPINFER_REMEASURE_STEP_COST=1``
    measures again)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    config = hashlib.sha256(repr(model.config).encode()).hexdigest()[:16]
    replays = graphs is not None and graphs.capture
    key = curve_key(
        device=name, model=config, dtype=dtype, drafts=num_draft_tokens, max_tokens=max_tokens,
        block_size=block_size, batch_invariant=envs.batch_invariant(), version=__version__,
        graph_tokens=graphs.max_batch_size if replays else 0,
    )  # fmt: skip
    settings = dict(num_draft_tokens=num_draft_tokens, max_tokens=max_tokens,
                    block_size=block_size, dtype=dtype, device=device, graphs=graphs)  # fmt: skip
    return cached_step_cost_curve(
        key, lambda: measure_step_cost_curve(model, **settings), remeasure=remeasure
    )


def dummy_verify_plan(
    vocab: int, tokens: int, width: int, blocks_per_seq: int, layout: CacheLayout
) -> StepPlan:
    """A verification step of ``tokens`` rows: sequences of ``width`` rows (the last one
    shorter) from position 0, random token ids, blocks and state slots from 1 up (wrapping
    around within ``layout``: only the timing matters)."""
    lengths = [width] * (tokens // width) + ([tokens % width] if tokens % width else [])
    n = len(lengths)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    blocks = [1 + i % (layout.num_blocks - 1) for i in range(n * blocks_per_seq)]
    gen = torch.Generator().manual_seed(tokens)
    return StepPlan(
        request_ids=[f"profile-{b}" for b in range(n)],
        input_ids=torch.randint(0, vocab, (tokens,), generator=gen).tolist(),
        positions=[p for length in lengths for p in range(length)],
        cu_seqlens_q=cu,
        seq_lens=lengths,
        block_tables=[blocks[b * blocks_per_seq : (b + 1) * blocks_per_seq] for b in range(n)],
        state_slots=[1 + b % (layout.num_slots - 1) for b in range(n)],
        is_fresh=[True] * n,
        num_drafts=[length - 1 for length in lengths],
        sample_rows=list(range(tokens)),
        sample_positions=[p + 1 for length in lengths for p in range(length)],
        sample_requests=[b for b, length in enumerate(lengths) for _ in range(length)],
        sample_seeds=[0] * tokens,
        prompt_logprob_rows=[],
        prompt_logprob_targets=[],
        prompt_logprob_requests=[],
        images=[],
    )


@torch.inference_mode()
def _time_step(model, plan: StepPlan, cache: ModelCache, graphs, device) -> float:
    """Milliseconds of one step: its graph's replay when ``graphs`` take it, else eager."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    logits = graphs.run(plan, plan.sample_rows) if graphs is not None else None
    if logits is None:
        model(step_batch(plan, plan.sample_rows, device), cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3
