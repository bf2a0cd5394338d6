"""RMSNorm Triton kernels against the reference, through the shared conformance kit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
OPS = ["rms_norm", "fused_add_rms_norm"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_backend_registers_the_norm_kernels():
    assert set(OPS) <= set(backend.ops)


@pytest.mark.parametrize("case", cases_for(OPS, "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS, "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def test_rejects_mismatched_weight():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight: expected shape"):
        backend.ops["rms_norm"](x, torch.ones(32, device=DEVICE), 1e-6)


def test_three_dimensional_input_keeps_its_shape():
    x = torch.randn(2, 3, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    got = backend.ops["rms_norm"](x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(
        got, backend.ops["rms_norm"](x.reshape(6, 64), w, 1e-6).view(2, 3, 64)
    )


@pytest.mark.parametrize("op", OPS)
def test_batch_invariance(op):
    """A row's output is bitwise identical whatever the batch it is normalised in."""
    hidden = 4096 if HAS_CUDA else 128
    sizes = (1, 7, 64, 1000) if HAS_CUDA else (1, 7, 64)
    fn = backend.ops[op]
    g = torch.Generator().manual_seed(0)
    big = torch.randn(max(sizes), hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(max(sizes), hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(DEVICE)
    args = (
        (lambda n: (big[:n], w, 1e-6))
        if op == "rms_norm"
        else (lambda n: (big[:n], res[:n], w, 1e-6))
    )
    first = [fn(*args(n)) for n in sizes]
    row0 = [r[0] if op == "rms_norm" else r[0][0] for r in first]
    for other in row0[1:]:
        assert torch.equal(other, row0[0])


def test_found_through_the_entry_point_and_listed_native():
    from deepinfer import kernels

    assert kernels.discover_backends()["nvidia"] is backend
    rows = dict(kernels.implementation_table())
    assert all(rows[op]["nvidia"] == "native" for op in OPS)
