"""The DP ranks as worker processes of this node, started by ``LLM`` (one per device).

:class:`SpawnedRanks` starts ``world_size`` processes (forkserver, so CUDA is safe in them),
each running :func:`~.worker.spawned_worker_main` over its own pipe, and steps them. Every wait
is bounded: a worker that raises, dies or stays silent past the timeout makes the call raise one
:class:`~deepinfer.parallel.WorkerError` naming the rank (a rank that died without a word first,
since its peers' errors are then consequences) and its last error or where it was stuck; every
worker is then stopped and reaped, and the group refuses further calls.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
import weakref
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.distributed.worker import RankInfo, WorkerSetup, spawned_worker_main
from deepinfer.parallel import WorkerError, find_free_port
from deepinfer.parallel.launch import stop_processes

LOAD_TIMEOUT_FACTOR = 30  # loading a large checkpoint takes far longer than a step
FAILURE_GRACE_S = 0.5  # after a failure, listen this long so the root cause is the one named
TERMINATE_GRACE_S = 2.0
STACK_DUMP_WAIT_S = 0.3


class SpawnedRanks:
    """The :class:`~.core.RankGroup` of worker processes this process started."""

    def __init__(self, config: EngineConfig, backend: str, num_threads: int = 0) -> None:
        self.world_size = config.data_parallel_size
        self.timeout_s = config.distributed_timeout_s
        self._stacks = tempfile.TemporaryDirectory(prefix="deepinfer-ranks-")
        environ = {k: v for k, v in os.environ.items() if k.startswith("DEEPINFER_")}
        setup = WorkerSetup(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{find_free_port()}",
            timeout_s=self.timeout_s,
            environ=environ,
            stack_dir=self._stacks.name,
            num_threads=num_threads,
        )
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=spawned_worker_main,
                args=(rank, self.world_size, config, setup, theirs),
                name=f"deepinfer-dp{rank}",
                daemon=True,
            )
            self._conns.append(ours)
            self._procs.append(proc)
        self._failure: WorkerError | None = None
        self._loaded = False
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._stacks)
        try:
            for proc in self._procs:
                proc.start()
            infos = self._gather(range(self.world_size), self.timeout_s * LOAD_TIMEOUT_FACTOR)
        except BaseException:
            self.close()
            raise
        self.infos: list[RankInfo] = [infos[rank] for rank in range(self.world_size)]
        self._loaded = True

    @property
    def num_draft_tokens(self) -> int:
        """Drafts the ranks' executors propose (the scheduler then never runs ahead of them)."""
        return self.infos[0].num_draft_tokens

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def execute(self, outputs: dict[int, SchedulerOutput]) -> dict[int, ModelRunnerOutput]:
        return self.launch(outputs).result()

    def launch(self, outputs: dict[int, SchedulerOutput]) -> _SentSteps:
        """Send each rank its step and return; ``result()`` waits for the replies. A worker
        answers in the order it was sent steps, so the next step may go out first."""
        if self._failure is not None:
            raise WorkerError(self._failure.rank, f"the engine's workers stopped: {self._failure}")
        for rank, so in outputs.items():
            try:
                self._conns[rank].send(("execute", so))
            except (BrokenPipeError, OSError):
                break  # that worker is gone: _gather names it
        return _SentSteps(self, sorted(outputs))

    def collect(self, ranks: list[int]) -> dict[int, ModelRunnerOutput]:
        """The replies of ``ranks`` to their oldest step not yet collected."""
        if self._failure is not None:
            raise WorkerError(self._failure.rank, f"the engine's workers stopped: {self._failure}")
        try:
            return self._gather(ranks, self.timeout_s)
        except WorkerError:
            raise
        except BaseException:  # interrupted mid-step: replies would no longer match requests
            self._fail(WorkerError(0, "a step was interrupted; the workers were stopped"))
            raise

    def end_call(self) -> None:
        pass  # spawned workers serve until closed

    def close(self) -> None:
        """Ask the workers to stop, then stop and reap them (idempotent)."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):  # already gone
                conn.send(("stop", None))
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _gather(self, ranks, timeout_s: float) -> dict[int, Any]:
        """Each rank's reply; on any failure or at the deadline, stop all and raise."""
        waiting = set(ranks)
        replies: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while waiting:
            now = time.monotonic()
            if failed_at is not None and now - failed_at >= FAILURE_GRACE_S:
                break
            if failed_at is None and now >= deadline:
                raise self._fail(self._timed_out(sorted(waiting), timeout_s))
            limit = FAILURE_GRACE_S if failed_at is not None else deadline - now
            ready = wait([self._conns[r] for r in waiting] + self._sentinels(), timeout=limit)
            for rank in sorted(waiting):
                if self._conns[rank] in ready:
                    self._receive(rank, waiting, replies, errors)
            if errors or self._silent_deaths(replies, errors):
                failed_at = failed_at or time.monotonic()
        if errors or self._silent_deaths(replies, errors):
            raise self._fail(self._blame(replies, errors))
        return replies

    def _receive(self, rank: int, waiting: set, replies: dict, errors: dict) -> None:
        try:
            kind, payload = self._conns[rank].recv()
        except (EOFError, OSError):
            self._procs[rank].join(TERMINATE_GRACE_S)  # gone: its exit code tells why
            waiting.discard(rank)
            return
        waiting.discard(rank)
        if kind == "error":
            errors[rank] = payload
        else:
            replies[rank] = payload

    def _sentinels(self) -> list[int]:
        return [p.sentinel for p in self._procs if p.exitcode is None]

    def _silent_deaths(self, replies: dict, errors: dict) -> list[int]:
        """Ranks whose process ended without reporting an error (killed, crashed)."""
        return [
            rank
            for rank, proc in enumerate(self._procs)
            if proc.exitcode is not None and rank not in errors
        ]

    def _blame(self, replies: dict, errors: dict) -> WorkerError:
        silent = self._silent_deaths(replies, errors)
        for rank in silent:  # a last word may still sit in its pipe
            if self._conns[rank].poll():
                self._receive(rank, set(), replies, errors)
        silent = self._silent_deaths(replies, errors)
        if silent:
            rank = silent[0]
            code = self._procs[rank].exitcode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            message = f"rank {rank} died ({how}) without reporting an error"
            if not self._loaded:
                message += (
                    " while starting (a script that makes an LLM with data_parallel_size > 1 "
                    "needs its entry point under `if __name__ == '__main__':`)"
                )
        else:
            rank, trace = next(iter(errors.items()))
            message = f"rank {rank} failed: {trace.strip().splitlines()[-1]}\n{trace}"
        others = [f"rank {r}: {t.strip().splitlines()[-1]}" for r, t in errors.items() if r != rank]
        if others:
            message += "\nother ranks then failed too (" + "; ".join(others) + ")"
        return WorkerError(rank, message)

    def _timed_out(self, late: list[int], timeout_s: float) -> WorkerError:
        """Name the first late rank, with where each late rank was stuck."""
        for rank in late:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        message = f"rank {late[0]} (of late ranks {late}) did not answer within {timeout_s:g} s"
        for rank in late:
            path = Path(self._stacks.name, f"{rank}.txt")
            frames = path.read_text().strip().splitlines()[1:4] if path.exists() else []
            message += f"\nrank {rank} was at: " + (
                "\n".join(frames) or "(no stack: not responding)"
            )
        return WorkerError(late[0], message)

    def _fail(self, error: WorkerError) -> WorkerError:
        self._failure = error
        self._finalizer()
        return error


class _SentSteps:
    """Steps sent to the ranks; ``result()`` collects them (once, then cached)."""

    def __init__(self, group: SpawnedRanks, ranks: list[int]) -> None:
        self._group, self._ranks = group, ranks
        self._results: dict[int, ModelRunnerOutput] | None = None

    def result(self) -> dict[int, ModelRunnerOutput]:
        if self._results is None:
            self._results = self._group.collect(self._ranks)
        return self._results


def _stop(procs, conns, stacks) -> None:
    """Terminate, then kill, every worker still alive; reap them all; free the pipes."""
    stop_processes(procs)
    for conn in conns:
        conn.close()
    stacks.cleanup()
