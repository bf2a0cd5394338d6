"""The Communicator implementations in one process (multi-process runs are in test_dispatch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer.parallel.comm import Communicator, SingleProcessComm, TorchDistributedComm
from deepinfer.parallel.launch import find_free_port, init_process_group


@pytest.fixture
def group_of_one():
    init_process_group("gloo", 0, 1, f"tcp://127.0.0.1:{find_free_port()}", timeout_s=10)
    yield TorchDistributedComm()
    dist.destroy_process_group()


def test_single_process_comm_is_the_identity():
    comm = SingleProcessComm()
    assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (0, 1)
    source = torch.randn(5, 3)
    out = torch.empty_like(source)
    comm.all_to_all_single(out, source, [5], [5])
    assert torch.equal(out, source)
    gathered = torch.empty_like(source)
    comm.all_gather_into_tensor(gathered, source)
    assert torch.equal(gathered, source)
    reduced = source.clone()
    comm.all_reduce(reduced, op="max")
    assert torch.equal(reduced, source)
    comm.barrier()


def test_torch_distributed_comm_matches_single_process_in_a_group_of_one(group_of_one):
    comm = group_of_one
    assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (0, 1)
    source = torch.randn(4, 2).to(torch.bfloat16)
    for impl in (comm, SingleProcessComm()):
        out = torch.empty_like(source)
        impl.all_to_all_single(out, source, [4], [4])
        assert torch.equal(out, source)


@pytest.mark.parametrize("make", [SingleProcessComm, "group_of_one"])
def test_communicators_reject_bad_splits_and_ops(make, request):
    comm = request.getfixturevalue(make) if isinstance(make, str) else make()
    source = torch.randn(4, 2)
    with pytest.raises(
        ValueError, match=r"input_split_sizes: expected 1 non-negative sizes summing"
    ):
        comm.all_to_all_single(torch.empty(4, 2), source, [4], [3])
    with pytest.raises(ValueError, match=r"output_split_sizes: expected 1 non-negative sizes"):
        comm.all_to_all_single(torch.empty(4, 2), source, [5], [4])
    with pytest.raises(ValueError, match=r"op: expected one of \['max', 'min', 'product', 'sum'\]"):
        comm.all_reduce(source, op="avg")


def test_torch_distributed_comm_needs_an_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        TorchDistributedComm()
