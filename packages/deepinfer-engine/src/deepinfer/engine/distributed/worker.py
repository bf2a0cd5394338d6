"""One DP rank's worker: join the process group, load this rank's model and cache, serve steps.

The same loop serves a rank spawned by ``LLM`` (messages over a pipe from the front end) and
a rank started by ``torchrun`` (messages from rank 0 over the control group). Before
``load_executor`` runs, the default process group spans the DP ranks (rank = DP rank), so the
model side can form its expert-parallel communicator from it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import traceback
from dataclasses import dataclass, replace
from typing import Any

from deepinfer.engine.config import EngineConfig, LoadedModel

# Messages from the front end: ("execute", SchedulerOutput) | ("stop", None).
# Replies: ("loaded", RankInfo) | ("ok", ModelRunnerOutput) | ("error", traceback text).


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports after loading: its :class:`LoadedModel` without the executor (the
    tokenizer only from rank 0) and how many drafts its executor proposes."""

    rank: int
    loaded: LoadedModel
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class WorkerSetup:
    """How a spawned worker joins its group."""

    backend: str
    init_method: str
    timeout_s: float
    environ: dict[str, str]  # the front end's DEEPINFER_* variables, as they were at start
    stack_dir: str  # where the worker writes its stack when asked (SIGUSR1) at a deadline
    num_threads: int  # CPU threads for torch (0: leave torch's default)


def describe(rank: int, loaded: LoadedModel) -> RankInfo:
    """The picklable report of a loaded rank."""
    tokenizer = loaded.tokenizer if rank == 0 else None
    drafts = getattr(loaded.executor, "num_draft_tokens", 0)
    return RankInfo(rank, replace(loaded, executor=None, tokenizer=tokenizer), drafts)


def load_rank(config: EngineConfig) -> LoadedModel:
    """Load this rank's model, weights and cache (the process group is already formed); with
    context parallelism, form the CP groups."""
    from deepinfer.engine.runner.loading import load_executor

    loaded = load_executor(config)
    if config.context_parallel_size > 1:
        from deepinfer.engine.runner.context_executor import with_context_parallel

        loaded = with_context_parallel(loaded, config)
    return loaded


_stack_file = None  # kept open for faulthandler for the life of the worker


def spawned_worker_main(rank: int, world_size: int, config: EngineConfig, setup, conn) -> None:
    """Body of a spawned rank: every outcome is reported on ``conn`` before the process ends."""
    global _stack_file
    os.environ.update(setup.environ)
    _stack_file = open(os.path.join(setup.stack_dir, f"{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=False)
    try:
        import torch

        from deepinfer.parallel import init_process_group

        if setup.num_threads:
            torch.set_num_threads(setup.num_threads)
        init_process_group(setup.backend, rank, world_size, setup.init_method, setup.timeout_s)
        loaded = load_rank(config)
        conn.send(("loaded", describe(rank, loaded)))
        serve(loaded.executor, conn)
        torch.distributed.destroy_process_group()
    except BaseException:
        _report(conn, traceback.format_exc())
        raise SystemExit(1) from None


def serve(executor: Any, conn) -> None:
    """Run the steps the front end sends until it says stop (or goes away)."""
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return  # the front end is gone
        if kind == "stop":
            return
        conn.send(("ok", executor.execute(payload)))


def _report(conn, trace: str) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):  # the front end is gone: nobody to tell
        conn.send(("error", trace))
