"""The compressor reads its window rows from the state pool and this step's rows without
concatenating the pool: the same rows as ``torch.cat([pool, step])[rows]``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.compressor import _gather_two


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_gather_two_equals_concatenate_then_index(trailing):
    g = torch.Generator().manual_seed(8)
    pool = torch.randn(40, *trailing, generator=g)
    step = torch.randn(6, *trailing, generator=g)
    rows = torch.randint(0, 46, (9, 8), generator=g)
    rows[0, :4] = torch.tensor([0, 39, 40, 45])  # both ends of both sources
    assert torch.equal(_gather_two(pool, step, rows), torch.cat([pool, step])[rows])


def test_gather_two_only_step_rows():
    step = torch.randn(5, 4)
    rows = torch.tensor([[0, 1], [4, 2]])
    assert torch.equal(_gather_two(torch.empty(0, 4), step, rows), step[rows])
