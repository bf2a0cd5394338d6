"""FP8 activation quantisation kernels against the reference, bit for bit.

On CPU (Triton interpreter) the kernels round in fp32 bit arithmetic before the e4m3 cast, since
the interpreter's own cast drops mantissa carries (toolchain.md); on the GPU the hardware cast
rounds. Either way the conformance kit demands bit equality.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import quant
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
OPS_HERE = ["fp8_act_quant", "fp8_sim"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_quant_kernels_are_registered():
    assert IMPLEMENTATIONS["fp8_act_quant"] is quant.fp8_act_quant
    assert IMPLEMENTATIONS["fp8_sim"] is quant.fp8_sim


@pytest.mark.parametrize("case", cases_for(OPS_HERE, "small"), ids=str)
def test_conformance_small(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS_HERE, "real"), ids=str)
def test_conformance_real(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


def test_rounds_ties_to_even_and_carries_into_the_exponent():
    # Scale 1 (amax 448): 100 and 17 are ties (-> 96, 16), -124.5 carries (-> -128), then
    # subnormals: 7.5 * 2^-9 is a tie (-> 2^-6), 1e-3 rounds up to 2^-9.
    head = [448.0, 100.0, 17.0, -124.5, 7.5 * 2**-9, 1e-3, -300.0, 7.0]
    x = torch.tensor([head + [0.25] * 8], device=DEVICE)
    q, s = quant.fp8_act_quant(x, 16)
    assert s.item() == 1.0
    want = [448.0, 96.0, 16.0, -128.0, 2**-6, 2**-9, -288.0, 7.0]
    assert q.float().flatten()[:8].tolist() == want


@pytest.mark.parametrize("rows", [1, 37])
def test_m_major_scales_hold_the_same_values(rows):
    """``quantize_rows(m_major=True)`` (the layout cuBLAS's blockwise GEMM reads) writes the
    same codes and scales, with unit stride along M."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 512, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    q, s = quant.quantize_rows(x, 128)
    qm, sm = quant.quantize_rows(x, 128, m_major=True)
    assert sm.shape == (rows, 4) and sm.stride() == (1, rows)
    assert torch.equal(qm.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sm, s)


def test_in_place_round_trip():
    x = torch.randn(6, 256, device=DEVICE).bfloat16()
    want = quant.fp8_sim(x, 32)
    quant.fp8_sim(x, 32, out=x)
    assert torch.equal(x, want)


def test_rejects_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match="group_size=48"):
        quant.fp8_act_quant(torch.randn(2, 96, device=DEVICE), 48)


def test_batch_invariance():
    """A row's quantisation is bitwise identical whatever the batch around it."""
    sizes = (1, 7, 64, 1000) if HAS_CUDA else (1, 7, 64)
    big = torch.randn(max(sizes), 512, device=DEVICE).bfloat16()
    outs = [quant.fp8_act_quant(big[:n], 128) for n in sizes]
    for q, s in outs[1:]:
        assert torch.equal(q[0].view(torch.uint8), outs[0][0][0].view(torch.uint8))
        assert torch.equal(s[0], outs[0][1][0])
