"""An engine on an accelerator runs torch's CPU ops on one thread unless OMP_NUM_THREADS says
otherwise; a CPU engine keeps its threads."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.runner.host_threads import limit_host_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_accelerator_engine_runs_host_ops_on_one_thread():
    assert limit_host_threads(torch.device("cuda"), environ={}) == 1
    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("two_threads")
def test_omp_num_threads_is_the_users_choice():
    assert limit_host_threads(torch.device("cuda"), environ={"OMP_NUM_THREADS": "2"}) == 2
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_cpu_engine_keeps_its_threads():
    assert limit_host_threads(torch.device("cpu"), environ={}) == 2
    assert torch.get_num_threads() == 2
