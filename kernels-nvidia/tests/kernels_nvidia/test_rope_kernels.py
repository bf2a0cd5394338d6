"""Partial interleaved RoPE kernel (forward and inverse) against the reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("case", cases_for(["apply_rope"], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(["apply_rope"], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def test_inverse_undoes_forward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=g).to(DEVICE)
    angles = (torch.rand(6, 8, generator=g) * 50).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    there = backend.ops["apply_rope"](x, cos, sin)
    assert not torch.allclose(there, x)
    torch.testing.assert_close(backend.ops["apply_rope"](there, cos, sin, inverse=True), x)


def test_rejects_bad_angles():
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin: expected"):
        backend.ops["apply_rope"](
            x, torch.ones(3, 8, device=DEVICE), torch.ones(3, 8, device=DEVICE)
        )
