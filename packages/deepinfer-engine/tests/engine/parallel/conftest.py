"""One intra-op thread for the tiny-model tests: on a shared 2-core machine torch's thread
pool spends far longer spinning than computing on these shapes (measured ~35x)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
