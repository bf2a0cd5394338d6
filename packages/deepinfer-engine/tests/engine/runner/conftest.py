"""Shared fixtures of the runner tests: one thread (the tiny model on a shared 2-core machine)
and the small random V4.1 checkpoint with three DSpark stages (block size 3)."""

import pytest
import torch

from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dspark_checkpoint(tmp_path_factory):
    """A float V4.1 checkpoint (8 layers, 3 DSpark stages, tokenizer) in a temp directory."""
    directory = tmp_path_factory.mktemp("dspark")
    make_random_checkpoint(directory, tiny_v41_config(vision=False), quantized=False, seed=0)
    return directory
