"""Engram and the DSpark drafter on the GPU match the CPU (real-width Engram rows).

Run on a GPU machine: ``.venv/bin/python -m pytest
packages/deepinfer-engine/tests/engine/model/test_engram_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.model.engram_hashing import EngramHashLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_hash_of_the_released_layout_is_exact_on_the_gpu():
    layout = EngramHashLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168, 384_016_682))
    ids = torch.randint(0, 99_092, (8192, 4))
    want = kernels.engram_hash(ids, layout.multipliers, layout.primes, layout.offsets)
    got = kernels.engram_hash(
        ids.cuda(), layout.multipliers.cuda(), layout.primes.cuda(), layout.offsets.cuda()
    )
    assert torch.equal(got.cpu(), want)
    assert bool((want >= 0).all()) and bool((want < 384_016_682).all())


def test_fp8_lookup_and_gate_at_v41_width_match_the_cpu():
    rows, width, dim = 100_000, 256, 5120
    weight = (torch.randn(rows, width) * 2).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 135, (rows, width // 32), dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )
    row_ids = torch.randint(0, rows, (512, 24))
    want = kernels.engram_embedding_lookup(weight, scale, row_ids)
    got = kernels.engram_embedding_lookup(weight.cuda(), scale.cuda(), row_ids.cuda())
    assert torch.equal(got.cpu(), want)

    hidden = torch.randn(512, 4, dim).bfloat16()
    key, value = torch.randn(512, 4, dim).bfloat16(), torch.randn(512, dim).bfloat16()
    qw, kw = (torch.rand(4, dim) + 0.5).bfloat16(), (torch.rand(4, dim) + 0.5).bfloat16()
    mask = torch.rand(512) > 0.1
    args = (hidden, key, value, qw, kw, mask, 1e-20)
    want = kernels.engram_gate(*args)
    got = kernels.engram_gate(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(got.cpu(), want, atol=1.6e-2, rtol=1.6e-2)
    assert torch.equal(got.cpu()[~mask], hidden[~mask])
