"""Greedy decoding of a few sequences with the model driven directly, one step per call, so that
expert-parallel ranks can step in lockstep outside the engine (tests, benchmarks).

Every rank calls :func:`greedy_lockstep` with the same ``num_steps``; a step in which the rank
has nothing to run is an :func:`~deepinfer.engine.model.expert_parallel.idle_step`, so the
collectives of the expert-parallel layers always match across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.engine.model.expert_parallel import idle_step
from deepinfer.engine.testing.simple_runner import SimpleRunner


@dataclass
class GreedyTrace:
    """One sequence's greedy continuation: the tokens and each step's fp32 logprobs row."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)


@torch.no_grad()
def greedy_lockstep(
    model: nn.Module,
    prompts: Mapping[int, Sequence[int]],
    max_new_tokens: Mapping[int, int],
    num_steps: int,
    *,
    block_size: int = 128,
    between_steps: Callable[[int], None] | None = None,
) -> dict[int, GreedyTrace]:
    """Prefill every prompt in step 0, then decode one token per sequence per step until it has
    ``max_new_tokens[seq]`` tokens; ``num_steps`` steps in all. ``between_steps(step)`` runs
    after each step (e.g. an EPLB rebalance)."""
    longest = max((len(p) + max_new_tokens[s] for s, p in prompts.items()), default=1)
    runner = SimpleRunner(
        model, max_seqs=max(prompts, default=0) + 1, max_len=longest, block_size=block_size
    )
    traces = {seq: GreedyTrace() for seq in prompts}
    for step in range(num_steps):
        if step == 0:
            chunks = {seq: list(p) for seq, p in prompts.items()}
        else:
            chunks = {
                seq: [t.tokens[-1]]
                for seq, t in traces.items()
                if len(t.tokens) < max_new_tokens[seq]
            }
        if chunks:
            for seq, logits in runner.step(chunks).items():
                row = torch.log_softmax(logits[-1].float(), dim=-1)
                traces[seq].logprobs.append(row)
                traces[seq].tokens.append(int(row.argmax()))
        else:
            idle_step(model)
        if between_steps is not None:
            between_steps(step)
    return traces
