"""spawn: results by rank, and one clear error with no process left behind when a worker fails."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deepinfer.parallel.comm import TorchDistributedComm
from deepinfer.parallel.launch import (
    WorkerError,
    find_free_port,
    init_from_env,
    read_env,
    spawn,
)


def _record_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _sum_ranks(rank: int, world_size: int, pid_dir: str) -> tuple[int, float]:
    _record_pid(pid_dir, rank)
    total = torch.tensor([float(rank)])
    TorchDistributedComm().all_reduce(total)
    return rank, total.item()


def _fail(rank: int, world_size: int, pid_dir: str, how: str, bad_rank: int) -> None:
    """``bad_rank`` raises, exits abruptly or hangs; the others wait for it in a collective."""
    _record_pid(pid_dir, rank)
    if rank == bad_rank:
        if how == "raise":
            raise ValueError(f"bad input on rank {rank}")
        if how == "exit":
            os._exit(3)
        time.sleep(3600)
    dist.barrier()


def _assert_all_gone(pid_dir: Path, world_size: int) -> None:
    assert multiprocessing.active_children() == []
    pids = [int(pid_dir.joinpath(f"{rank}.pid").read_text()) for rank in range(world_size)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie or an orphan


def test_spawn_returns_every_rank_result_in_rank_order(tmp_path):
    results = spawn(_sum_ranks, 4, str(tmp_path), timeout_s=60)
    assert results == [(rank, 6.0) for rank in range(4)]
    _assert_all_gone(tmp_path, 4)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("raise", "rank 1 failed: ValueError: bad input on rank 1"),
        ("exit", "rank 1 died with exit code 3"),
    ],
    ids=["raise", "exit"],
)
def test_spawn_names_the_failing_rank_and_leaves_no_process(tmp_path, how, expected):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=expected) as caught:
        spawn(_fail, 2, str(tmp_path), how, 1, timeout_s=60)
    assert caught.value.rank == 1
    assert time.monotonic() - start < 20  # far inside the 60 s timeout
    _assert_all_gone(tmp_path, 2)


def test_spawn_times_out_on_a_hung_worker(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out after 4 s") as caught:
        spawn(_fail, 2, str(tmp_path), "hang", 0, timeout_s=4)
    # rank 1 sits in the barrier (gloo's own timeout is also 4 s); rank 0 sleeps
    assert caught.value.rank in (0, 1)
    # where each late rank was stuck: rank 0 in the sleep of _fail, rank 1 in the barrier
    assert re.search(
        r"rank 0 was at:\s+File .*test_launch.py\", line \d+ in _fail", str(caught.value)
    )
    assert time.monotonic() - start < 15
    _assert_all_gone(tmp_path, 2)


def test_read_env_parses_torchrun_variables_and_names_missing_ones():
    env = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    parsed = read_env({**env, "LOCAL_RANK": "1"})
    assert (parsed.rank, parsed.world_size, parsed.local_rank) == (3, 8, 1)
    assert (parsed.master_addr, parsed.master_port) == ("10.0.0.1", 29500)
    assert read_env(env).local_rank == 3  # one node: local rank = rank
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_PORT: not set"):
        read_env({"RANK": "0", "MASTER_ADDR": "x"})
    with pytest.raises(ValueError, match="RANK: expected an integer, got 'a'"):
        read_env({**env, "RANK": "a"})
    with pytest.raises(ValueError, match="RANK: expected 0 <= RANK < WORLD_SIZE=8"):
        read_env({**env, "RANK": "8"})


def test_init_from_env_forms_a_group_of_one(monkeypatch):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    env = init_from_env("gloo", timeout_s=10)
    try:
        comm = TorchDistributedComm()
        assert (env.rank, comm.rank, comm.world_size) == (0, 0, 1)
        tensor = torch.tensor([2.0, 3.0])
        comm.all_reduce(tensor, op="max")
        assert tensor.tolist() == [2.0, 3.0]
    finally:
        dist.destroy_process_group()
