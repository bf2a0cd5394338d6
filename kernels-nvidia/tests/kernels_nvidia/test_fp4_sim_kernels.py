"""fp4_sim Triton kernel: bit-exact with the reference (conformance kit, planted ties), on the
interpreter at small shapes and on the GPU at model shapes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import OPS
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("case", cases_for(["fp4_sim"], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(["fp4_sim"], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.parametrize("scale_fmt,group", [("ue8m0", 32), ("e4m3", 16)])
def test_wide_magnitudes_and_signed_zeros(scale_fmt, group):
    """Blocks from tiny (subnormal e4m3 scales) to huge (saturated scale), zeros, negatives."""
    gen = torch.Generator().manual_seed(5)
    rows = 2.0 ** torch.arange(-40, 24, 4, dtype=torch.float32)
    x = torch.randn(rows.numel(), 4 * group, generator=gen) * rows[:, None]
    x[0, :group] = 0.0
    x[1, :group] = -0.0
    x = x.to(DEVICE)
    want = OPS["fp4_sim"].reference(x, group, scale_fmt=scale_fmt)
    got = backend.ops["fp4_sim"](x, group, scale_fmt=scale_fmt)
    assert torch.equal(got, want)


def test_rejects_block_not_dividing():
    with pytest.raises(ValueError, match="block_size=48"):
        backend.ops["fp4_sim"](torch.randn(2, 64, device=DEVICE), 48)


def test_block_not_a_power_of_two_matches_the_reference():
    x = torch.randn(3, 96, device=DEVICE)
    want = OPS["fp4_sim"].reference(x, 48)
    assert torch.equal(backend.ops["fp4_sim"](x, 48), want)
