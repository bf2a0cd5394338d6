"""Process start-up: one process per rank on this node (``spawn``), or ranks started by torchrun.

``spawn`` is the one-node launcher: it starts ``world_size`` processes (forkserver or spawn start
method, so CUDA is safe in the children), initialises the default process group in each, runs
``fn(rank, world_size, *args)`` and returns every rank's result. A worker that raises, dies or
runs past the timeout makes the call raise one :class:`WorkerError` naming the rank and its last
error (for a hang: where each late rank was stuck, from a faulthandler stack dump); every
remaining worker is killed first, so no process is left behind and nothing hangs.
Under ``torchrun`` each process calls :func:`init_from_env` instead.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# After the first failure, how long to keep listening so the root cause (often a rank that died
# without a word, while its peers report broken connections) is the one named.
FAILURE_GRACE_S = 0.5
# How long a terminated worker gets before it is killed outright.
TERMINATE_GRACE_S = 2.0
# How long a late worker gets to write its stack after SIGUSR1.
STACK_DUMP_WAIT_S = 0.3
_POLL_S = 0.05


class WorkerError(RuntimeError):
    """A spawned worker raised, died or timed out; ``rank`` is the one blamed."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class DistributedEnv:
    """The rank layout torchrun (or any launcher) hands a process through its environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def find_free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """``"nccl"`` when CUDA devices are visible, else ``"gloo"`` (CPU)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend: str, rank: int, world_size: int, init_method: str, timeout_s: float = 60.0
) -> None:
    """Initialise the default process group; every collective in it times out after ``timeout_s``.

    With ``backend="nccl"`` the process first binds to device ``rank % device_count``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def read_env(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """Parse ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``)."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"{', '.join(missing)}: not set (expected from torchrun or the launcher)")
    values = {}
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        raw = env.get(key, env["RANK"] if key == "LOCAL_RANK" else None)
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {raw!r}") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(f"RANK: expected 0 <= RANK < WORLD_SIZE={values['WORLD_SIZE']}")
    return DistributedEnv(
        rank=values["RANK"],
        world_size=values["WORLD_SIZE"],
        local_rank=values["LOCAL_RANK"],
        master_addr=env["MASTER_ADDR"],
        master_port=values["MASTER_PORT"],
    )


def init_from_env(backend: str | None = None, timeout_s: float = 60.0) -> DistributedEnv:
    """Initialise the default process group from torchrun's environment; returns the layout."""
    env = read_env()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return env


@dataclass(frozen=True)
class _WorkerSetup:
    backend: str
    init_method: str
    timeout_s: float
    stack_dir: str  # where a worker writes its stack on SIGUSR1 (asked for at the deadline)


_stack_file = None  # kept open for faulthandler for the life of the worker


def _worker(fn, rank, world_size, setup: _WorkerSetup, results, args) -> None:
    """Body of one spawned process: report ``(rank, ok, payload)`` exactly once."""
    global _stack_file
    _stack_file = open(os.path.join(setup.stack_dir, f"{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=False)
    try:
        init_process_group(setup.backend, rank, world_size, setup.init_method, setup.timeout_s)
        result = fn(rank, world_size, *args)
        # Plain pickle here (tensors by value, not by shared-memory handle, so the result
        # outlives this process), not in the queue's feeder thread, so an unpicklable result is
        # this rank's error rather than a silent exit.
        payload = pickle.dumps(result)
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((rank, True, payload))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). The default start
    method, ``"forkserver"`` with torch preloaded in the server, is as CUDA-safe as ``"spawn"``
    (the server never touches a device) but starts each worker without a fresh torch import
    (about 3 s of CPU each); ``"spawn"`` remains available. Collectives of the
    group time out after ``timeout_s``, and the whole call too. On any failure all workers are
    killed and one :class:`WorkerError` names the first rank that raised, or a rank that died
    without reporting (its peers' errors are then consequences), or the ranks still running
    at the deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method: expected 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    results = ctx.Queue()
    stack_dir = tempfile.TemporaryDirectory(prefix="deepinfer-stacks-")
    setup = _WorkerSetup(backend, f"tcp://127.0.0.1:{find_free_port()}", timeout_s, stack_dir.name)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, setup, results, args),
            name=f"deepinfer-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        payloads = _collect(procs, results, time.monotonic() + timeout_s, setup)
    finally:
        stop_processes(procs)
        results.close()
        results.cancel_join_thread()
        stack_dir.cleanup()
    return [pickle.loads(payloads[rank]) for rank in range(world_size)]


def _collect(procs, results, deadline: float, setup: _WorkerSetup) -> dict[int, bytes]:
    """Wait for every rank's report; raise :class:`WorkerError` on the first failure."""
    payloads: dict[int, bytes] = {}
    errors: dict[int, str] = {}  # in the order they arrived
    failed_at = None
    while len(payloads) < len(procs):
        _drain(results, payloads, errors, _POLL_S)
        if errors or _silent_deaths(procs, payloads, errors):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at >= FAILURE_GRACE_S:
                break
        elif time.monotonic() > deadline:
            raise _timed_out(procs, payloads, setup)
    else:
        return payloads
    _drain(results, payloads, errors, 0.0)
    raise _blame(procs, payloads, errors)


def _timed_out(procs, payloads: dict, setup: _WorkerSetup) -> WorkerError:
    """Name the first rank still running, with where each late rank is stuck."""
    late = [rank for rank in range(len(procs)) if rank not in payloads]
    for rank in late:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT_S)
    message = (
        f"rank {late[0]} (of ranks {late} still running) timed out after {setup.timeout_s:g} s"
    )
    for rank in late:
        path = Path(setup.stack_dir, f"{rank}.txt")
        frames = path.read_text().strip().splitlines()[1:4] if path.exists() else []
        message += f"\nrank {rank} was at: " + ("\n".join(frames) or "(not started)")
    return WorkerError(late[0], message)


def _drain(results, payloads: dict, errors: dict, wait_s: float) -> None:
    """Move every report already queued (waiting up to ``wait_s`` for the first) into the maps."""
    while True:
        try:
            rank, ok, payload = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        except queue.Empty:
            return
        (payloads if ok else errors)[rank] = payload
        wait_s = 0.0


def _silent_deaths(procs, payloads: dict, errors: dict) -> list[int]:
    """Ranks whose process ended without a report (killed, ``os._exit``, a crash)."""
    return [
        rank
        for rank, proc in enumerate(procs)
        if proc.exitcode is not None and rank not in payloads and rank not in errors
    ]


def _blame(procs, payloads: dict, errors: dict) -> WorkerError:
    silent = _silent_deaths(procs, payloads, errors)
    if silent:
        rank = silent[0]
        message = f"rank {rank} died with exit code {procs[rank].exitcode} before reporting"
    else:
        rank, trace = next(iter(errors.items()))
        last_line = trace.strip().splitlines()[-1]
        message = f"rank {rank} failed: {last_line}\n{trace}"
    others = [f"rank {r}: {t.strip().splitlines()[-1]}" for r, t in errors.items() if r != rank]
    if others:
        message += "\nother ranks then failed too (" + "; ".join(others) + ")"
    return WorkerError(rank, message)


def stop_processes(procs) -> None:
    """Terminate, then kill, every worker still alive, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        if proc.pid is None:
            continue  # never started
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
