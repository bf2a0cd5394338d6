"""Start the DP ranks of an ``LLM`` with ``data_parallel_size`` > 1 and build its engine core.

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment) the launched processes are
the ranks; otherwise this process spawns one worker per rank. Before anything starts, the
layout is checked against the model and the devices, failing with one line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from deepinfer.engine.config import EngineConfig, LoadedModel
from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.distributed.context_core import ContextParallelCore
from deepinfer.engine.distributed.core import DataParallelCore

logger = logging.getLogger("deepinfer.engine")

PROCESS_GROUP_BACKENDS = {"nvidia": "nccl", "ascend": "hccl", "cpu": "gloo"}


def start_ranks(config: EngineConfig) -> LoadedModel:
    """Validate the layout, start (or join) the ranks and load every rank's model and cache.

    The result's ``executor`` is the rank group (a :class:`~.core.RankGroup`, or on a torchrun
    rank other than 0 a :class:`~.torchrun.TorchrunFollower`); its capacity is the smallest
    rank's, so every rank's scheduler can use the same configuration.
    """
    from deepinfer import kernels
    from deepinfer.parallel import read_env

    accelerator = kernels.select_accelerator(config.accelerator).accelerator
    backend = PROCESS_GROUP_BACKENDS[accelerator]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from deepinfer.engine.distributed.torchrun import join_torchrun

        env = read_env()
        validate_layout(config, accelerator, local_ranks=None)
        return join_torchrun(config, env, backend)
    validate_layout(config, accelerator, local_ranks=config.data_parallel_size)
    from deepinfer.engine.distributed.spawned import SpawnedRanks

    num_threads = 0
    if accelerator == "cpu":  # the ranks share this machine's cores
        num_threads = max(1, (os.cpu_count() or 1) // config.data_parallel_size)
    ranks = SpawnedRanks(config, backend, num_threads)
    first = ranks.infos[0].loaded
    logger.info(
        "data parallel: %d ranks (expert parallel %d) over %s, asynchronous scheduling %s",
        config.data_parallel_size,
        config.expert_parallel_size,
        backend,
        "on" if config.async_scheduling else "off",
    )
    return replace(
        first,
        executor=ranks,
        num_blocks=min(info.loaded.num_blocks for info in ranks.infos),
        num_state_slots=min(info.loaded.num_state_slots for info in ranks.infos),
    )


def validate_layout(config: EngineConfig, accelerator: str, local_ranks: int | None) -> None:
    """Raise one ``ValueError`` line if the model's experts do not split over the EP ranks, it
    has no compressed attention for context parallelism, or this node has fewer devices than
    the ``local_ranks`` processes it should run."""
    from deepinfer.engine.checkpoint import resolve_model_path
    from deepinfer.engine.model.config_parsing import load_config
    from deepinfer.parallel.context import check_context_parallel

    path = resolve_model_path(config.model, weights=False)
    model_config = load_config(path)
    cp, ratios = config.context_parallel_size, model_config.compress_ratios
    check_context_parallel(cp, config.data_parallel_size, ratios)
    num_experts = model_config.n_routed_experts
    num_devices = local_ranks or config.data_parallel_size  # torchrun placed the processes
    if local_ranks is not None and accelerator == "nvidia":
        import torch

        num_devices = torch.cuda.device_count()
    config.parallel_config().validate_for(num_experts=num_experts, num_devices=num_devices)


def make_core(config: EngineConfig, scheduler_config: SchedulerConfig, loaded: LoadedModel) -> Any:
    """The engine core over the started ranks: a :class:`DataParallelCore` (a
    :class:`~.context_core.ContextParallelCore` with context parallelism) on rank 0 or the
    spawning process, or the torchrun follower itself."""
    if getattr(loaded.executor, "is_follower", False):
        return loaded.executor
    schedulers = [
        Scheduler(scheduler_config, tokenizer=loaded.tokenizer)
        for _ in range(config.data_parallel_size)
    ]
    ranks = loaded.executor
    if config.async_scheduling and not hasattr(ranks, "launch"):
        logger.info(
            "data parallel under torchrun: the ranks step synchronously (asynchronous "
            "scheduling does not span torchrun ranks yet)"
        )
    options = dict(
        every_rank_steps=config.expert_parallel_size > 1,
        async_scheduling=bool(config.async_scheduling),
        speculative=getattr(ranks, "num_draft_tokens", 0) > 0,
    )
    if config.context_parallel_size > 1:
        cp, min_tokens = config.context_parallel_size, config.cp_min_tokens
        num_drafts = getattr(ranks, "num_draft_tokens", 0)
        tail = _draft_window(config, num_drafts) if num_drafts else 1
        return ContextParallelCore(
            schedulers, ranks, context_parallel_size=cp, cp_min_tokens=min_tokens,
            num_tail_tokens=tail, **options,
        )  # fmt: skip
    return DataParallelCore(schedulers, ranks, **options)


def _draft_window(config: EngineConfig, num_draft_tokens: int) -> int:
    """Prompt positions whose taps the draft stages' window rings hold."""
    from deepinfer.engine.checkpoint import resolve_model_path
    from deepinfer.engine.model.config_parsing import load_config

    path = resolve_model_path(config.model, weights=False)
    return load_config(path).sliding_window + num_draft_tokens
