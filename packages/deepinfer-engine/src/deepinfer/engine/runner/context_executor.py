"""The executor of a rank in a context-parallel group: a step's CP prefill chunk runs first,
then the step's own work.

A chunk (:class:`~deepinfer.engine.core.scheduler_output.ContextPrefill`) is a collective of
the rank's CP group: every rank of it gets the same prompt rows, computes the share
:meth:`~deepinfer.engine.model.context_prefill.RowSplit.balanced` deals it
(:func:`~deepinfer.engine.model.context_prefill.context_parallel_prefill`) and ends with the
whole chunk in its own reservation of the cache. When the request asks for prompt logprobs,
each rank scores its rows and the group all-gathers the scores (a few numbers a row, never
logits); the owner keeps them until the request's first own step reports them. Under expert
parallelism a rank whose group has no chunk runs an idle MoE step in its place.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from deepinfer.engine.config import EngineConfig, LoadedModel
from deepinfer.engine.core.scheduler_output import (
    ContextPrefill,
    ModelRunnerOutput,
    SchedulerOutput,
)
from deepinfer.engine.model.context_prefill import RowGather, RowSplit, context_parallel_prefill
from deepinfer.engine.model.expert_parallel import idle_step
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.runner.cache_ops import reset_slot
from deepinfer.parallel import Communicator


class ContextParallelExecutor:
    """Wraps a rank's executor (``execute``; every other attribute is the wrapped one's)."""

    execute_async = None  # a chunk must run before the step: every step goes through execute

    def __init__(self, executor: Any, comm: Communicator) -> None:
        self.executor, self.comm = executor, comm
        self.model, self.cache = executor.model, executor.cache
        self.device = next(iter(self.cache.tensors.values())).device
        self.kept: dict[str, list[dict[int, float]]] = {}  # owner: prompt logprobs to report

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        chunk = so.context_prefill
        if chunk is not None:
            so = replace(so, context_prefill=None)
            if chunk.request_id is None:
                idle_step(self.model)
            else:
                self.prefill(chunk)
        out = self.executor.execute(so)
        for new in so.new_requests:  # a CP-prefilled request's first own step
            kept = self.kept.pop(new.request_id, None)
            if kept is not None and new.num_computed_tokens:  # (else recomputed alone)
                out.prompt_logprobs[new.request_id] = kept + out.prompt_logprobs.get(
                    new.request_id, []
                )
        for request_id in so.finished_request_ids:  # aborted before its first own step
            self.kept.pop(request_id, None)
        return out

    @torch.inference_mode()
    def prefill(self, chunk: ContextPrefill) -> None:
        """Run this rank's share of ``chunk``; the owner keeps its prompt logprobs."""
        if chunk.is_first:
            reset_slot(self.cache, chunk.state_slot)
        num_rows = len(chunk.token_ids) - 1
        split = RowSplit.balanced(num_rows, self.comm.world_size, self.model.config)
        k = chunk.prompt_logprobs
        long = dict(dtype=torch.long, device=self.device)
        # without prompt logprobs one row a rank (the head's smallest product), then dropped
        wanted = range(num_rows) if k is not None else [int(r[0]) for r in split.rows]
        batch = ForwardBatch(
            input_ids=torch.tensor(chunk.token_ids[:-1], **long),
            positions=torch.arange(chunk.start, chunk.start + num_rows, **long),
            cu_seqlens_q=torch.tensor([0, num_rows], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([chunk.start + num_rows], **long),
            block_tables=torch.tensor([chunk.block_ids], dtype=torch.int32, device=self.device),
            state_slots=torch.tensor([chunk.state_slot], **long),
            logits_indices=torch.tensor(list(wanted), **long),
        )
        logits = context_parallel_prefill(self.model, self.cache, batch, split, self.comm)
        if k is None:
            return
        entries = self._prompt_logprobs(logits, split, chunk.token_ids, k, chunk.is_owner)
        if entries is not None:
            self.kept.setdefault(chunk.request_id, []).extend(entries)

    def _prompt_logprobs(self, logits, split: RowSplit, tokens: list[int], k: int, keep: bool):
        """``{prompt token: logprob}`` plus the top ``k`` per row of the chunk, as the runner
        reports prompt logprobs, from this rank's rows' ``logits`` and the other ranks' (every
        rank takes part in the gathers; only ``keep`` builds the entries)."""
        gather = RowGather(self.comm, split, self.device)
        own = split.rows[self.comm.rank].long()
        targets = torch.tensor(tokens[1:], dtype=torch.long)[own].to(self.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scored = [gather(logprobs.gather(1, targets[:, None])[:, 0])]
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            scored += [gather(top.indices), gather(top.values)]
        if not keep:
            return None
        entries = [{token: logprob} for token, logprob in zip(tokens[1:], scored[0].tolist())]
        if k > 0:
            for entry, ids, vals in zip(entries, scored[1].tolist(), scored[2].tolist()):
                entry.update(zip(ids, vals))
        return entries

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)


def context_group(context_parallel_size: int, timeout_s: float) -> Communicator:
    """This rank's CP group: ranks ``C * g .. C * g + C - 1`` of the default process group
    (every rank forms every group, in the same order, as ``new_group`` requires), whose
    collectives time out after ``timeout_s``."""
    from datetime import timedelta

    import torch.distributed as dist

    from deepinfer.parallel import TorchDistributedComm

    world, rank, cp = dist.get_world_size(), dist.get_rank(), context_parallel_size
    if cp == world:
        return TorchDistributedComm()
    mine, timeout = None, timedelta(seconds=timeout_s)
    for first in range(0, world, cp):
        group = dist.new_group(list(range(first, first + cp)), timeout=timeout)
        if first <= rank < first + cp:
            mine = group
    return TorchDistributedComm(mine)


def with_context_parallel(loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
    """``loaded`` with its executor wrapped for CP prefills (the process group is formed);
    refuses YoCo truncation, which a CP prefill does not apply, in one line."""
    cp = config.context_parallel_size
    executor = loaded.executor
    if getattr(executor.model, "truncation", None) is not None:
        raise ValueError(
            f"context_parallel_size={cp}: YoCo prefill truncation does not run with context "
            "parallelism; set yoco_prefill_truncation_mode='off'"
        )
    return replace(
        loaded,
        executor=ContextParallelExecutor(executor, context_group(cp, config.distributed_timeout_s)),
    )
