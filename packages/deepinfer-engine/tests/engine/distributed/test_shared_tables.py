"""Host Engram tables in node shared memory: two ranks on one node (CPU processes over gloo)
map one copy that the first rank filled, read-only, and neither holds a private copy; two ranks
on different hosts (as the test lays them out) each fill and map their own.

A table here is 32 MiB of FP8 rows (plus its scales), large next to the noise of a process's
resident memory, so "no private copy" is a measurement: each rank's anonymous resident memory
(``RssAnon``) grows by far less than a table while it places and reads every byte of it, and its
shared resident memory (``RssShmem``) by the table. The leader fills a table from a checkpoint in
slices (never a whole private copy), bitwise as the whole-tensor load. The engine-level check (both DP ranks of an
``LLM`` map the same files, and outputs equal the single process) is in
``test_llm_data_parallel.py``.
"""

from __future__ import annotations

import multiprocessing
import queue
import traceback

import pytest
import torch
from torch import nn

from deepinfer import kernels
from deepinfer.engine.checkpoint import loader
from deepinfer.engine.checkpoint.loader import fill_tensors, load_into
from deepinfer.engine.distributed import shared_tables
from deepinfer.engine.distributed.shared_tables import (
    NodeTableShare,
    deferred_table_tensors,
    shared_table_mappings,
)
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.engram import EngramTable, host_tables_deferred
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config
from deepinfer.parallel import find_free_port

ROWS, WIDTH = 1 << 20, 32  # 32 MiB of FP8 rows, 1 MiB of scales
SEED = 7
TIMEOUT_S = 60


class _Tables(nn.Module):
    def __init__(self, host: bool = False, device="cpu", rows: int = ROWS) -> None:
        super().__init__()
        self.table = EngramTable(rows, WIDTH, True, torch.bfloat16, device=device, host=host)


def _status() -> dict[str, int]:
    """Resident memory of this process by kind, in bytes (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        lines = [line.split() for line in f if line.startswith(("RssAnon", "RssShmem"))]
    return {fields[0].rstrip(":"): int(fields[1]) * 1024 for fields in lines}


def _dummy_fill(tables: dict[str, torch.Tensor]) -> None:
    fill_tensors(tables, None, config=None, load_format="dummy", seed=SEED)


def _rank_main(rank: int, init_method: str, row_ids: torch.Tensor, node: str, results) -> None:
    try:
        torch.set_num_threads(1)
        shared_tables._node_key = lambda: node  # this child's host, as the test lays them out
        torch.distributed.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=2
        )
        with host_tables_deferred():
            model = _Tables()
        assert model.table.weight.is_meta and len(deferred_table_tensors(model)) == 2
        share = NodeTableShare.join(TIMEOUT_S)
        before = _status()
        num_bytes = share.place(model, _dummy_fill)
        table = model.table
        for t in (table.weight, table.scale):  # read every page
            t.view(torch.uint8).max()
        after = _status()
        lookup = kernels.engram_embedding_lookup(table.weight, table.scale, row_ids)
        results.put((rank, {
            "is_leader": share.is_leader, "num_local_ranks": share.num_local_ranks,
            "num_bytes": num_bytes, "lookup": lookup.float().numpy(),  # by value
            "anon_growth": after["RssAnon"] - before["RssAnon"],
            "shmem_growth": after["RssShmem"] - before["RssShmem"],
            "mappings": shared_table_mappings(),
        }))  # fmt: skip
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run_two_ranks(row_ids: torch.Tensor, nodes: tuple[str, str]) -> dict[int, dict]:
    """Two forked ranks, rank ``r`` on host ``nodes[r]``; each one's report."""
    ctx = multiprocessing.get_context("fork")  # no CUDA here; fast to start
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, init_method, row_ids, nodes[r], results), daemon=True
        )
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        replies = dict(results.get(timeout=TIMEOUT_S) for _ in procs)
    except queue.Empty:
        pytest.fail(f"the ranks did not answer within {TIMEOUT_S} s")
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S / 4)
            if proc.is_alive():
                proc.kill()
                proc.join()
    for rank, reply in replies.items():
        assert isinstance(reply, dict), f"rank {rank} failed:\n{reply}"
    return replies


@pytest.mark.parametrize("nodes", [("a", "a"), ("a", "b")], ids=["one-node", "two-nodes"])
def test_the_ranks_of_a_node_map_one_read_only_copy_and_hold_no_private_one(nodes):
    torch.manual_seed(0)
    row_ids = torch.randint(0, ROWS, (17, 4))
    replies = _run_two_ranks(row_ids, nodes)
    reference = _Tables()  # the same dummy fill, in this process's own memory
    _dummy_fill(dict(reference.state_dict()))
    want = kernels.engram_embedding_lookup(reference.table.weight, reference.table.scale, row_ids)
    table_bytes = ROWS * WIDTH + ROWS * WIDTH // 32
    one_node = nodes[0] == nodes[1]
    assert [replies[r]["is_leader"] for r in (0, 1)] == [True, not one_node]
    inodes = []
    for rank in (0, 1):
        reply = replies[rank]
        assert reply["num_local_ranks"] == (2 if one_node else 1)
        assert reply["num_bytes"] == table_bytes
        got = torch.from_numpy(reply["lookup"])
        assert torch.equal(got, want.float())  # its node leader's fill, as this rank reads it
        names = {m.name: m for m in reply["mappings"]}
        assert sorted(names) == ["table.scale", "table.weight"]
        assert all(m.perms == "r--s" for m in names.values())  # read-only, shared
        assert sum(m.num_bytes for m in names.values()) == table_bytes  # whole pages here
        inodes.append(sorted(m.inode for m in names.values()))
        assert reply["anon_growth"] < table_bytes // 8, f"rank {rank}: a private copy?"
        assert reply["shmem_growth"] >= table_bytes * 0.95
    assert (inodes[0] == inodes[1]) == one_node  # one copy per node: the same files


@pytest.mark.parametrize("quantized", [True, False], ids=["fp8-table", "float-table"])
def test_a_table_filled_in_slices_equals_the_whole_load(tmp_path, monkeypatch, quantized):
    directory = make_random_checkpoint(tmp_path, tiny_v41_config(), quantized=quantized, seed=3)
    config = load_config(directory)
    whole = build_model(config, device="cpu", dtype=torch.float32)
    load_into(whole, directory, config=config, progress=False)
    with host_tables_deferred():
        deferred = build_model(config, device="cpu", dtype=torch.float32)
    load_into(deferred, directory, config=config, progress=False)  # skips the tables
    tables = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in deferred_table_tensors(deferred)}
    assert len(tables) == len(config.engram_layer_ids) * (2 if quantized else 1)
    monkeypatch.setattr(loader, "FILL_SLICE_BYTES", 1000)  # a few rows a slice, a ragged last
    fill_tensors(tables, directory, config=config)
    expected = whole.state_dict()
    for name, tensor in tables.items():
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), name


def _place_alone(model: nn.Module) -> None:
    """Place ``model``'s deferred tables as a job of one rank (this process)."""
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        NodeTableShare.join(TIMEOUT_S).place(model, _dummy_fill)
    finally:
        torch.distributed.destroy_process_group()


class _RefusingRuntime:
    """A CUDA runtime whose host registration fails (as where read-only registration is not
    supported)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        return 801  # cudaErrorNotSupported


def test_a_table_that_cannot_be_pinned_warns_and_serves_from_pageable_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", _RefusingRuntime)
    with host_tables_deferred():
        shared = _Tables(host=True, rows=4096)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister"):
        _place_alone(shared)
    monkeypatch.undo()
    reference = _Tables(rows=4096)
    _dummy_fill(dict(reference.state_dict()))
    row_ids = torch.randint(0, 4096, (9, 4))
    want = kernels.engram_embedding_lookup(reference.table.weight, reference.table.scale, row_ids)
    assert torch.equal(shared.table(row_ids, torch.bfloat16), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_shared_host_table_is_pinned_and_reads_what_a_device_table_reads_on_the_gpu():
    with host_tables_deferred():
        shared = _Tables(host=True, device="cuda")
    _place_alone(shared)
    table = shared.table
    assert table.weight.is_pinned() and table.scale.is_pinned()
    device = _Tables(device="cuda")
    device.table.weight.data.copy_(table.weight)
    device.table.scale.data.copy_(table.scale)
    row_ids = torch.randint(0, ROWS, (4096, 4), device="cuda")
    for prefetch in (True, False):
        if prefetch:
            table.prefetch(row_ids)
        got = table(row_ids, torch.bfloat16)
        assert torch.equal(got, device.table(row_ids, torch.bfloat16))
