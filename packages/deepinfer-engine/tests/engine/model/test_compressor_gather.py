"""The compressor reads its window rows from the state pool and this step's rows without
concatenating the pool: the same rows as ``torch.cat([pool, step])[rows]``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.compressor import TwoSources


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_two_sources_equals_concatenate_then_index(trailing):
    g = torch.Generator().manual_seed(8)
    pool = torch.randn(40, *trailing, generator=g)
    step = torch.randn(6, *trailing, generator=g)
    rows = torch.randint(0, 46, (9, 8), generator=g)
    rows[0, :4] = torch.tensor([0, 39, 40, 45])  # both ends of both sources
    rows[1, :2] = -1  # none: read as row 0, masked by the caller
    sources = TwoSources.of(rows, 40, 6)
    assert torch.equal(sources.take(pool, step), torch.cat([pool, step])[rows.clamp(min=0)])
    assert torch.equal(sources.missing[..., 0], rows < 0)


def test_two_sources_only_step_rows():
    step = torch.randn(5, 4)
    rows = torch.tensor([[0, 1], [4, 2]])
    assert torch.equal(TwoSources.of(rows, 0, 5).take(torch.empty(0, 4), step), step[rows])
