"""grouped_linear (V4's wo_a) Triton kernel against the reference, through the conformance kit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.reference.quant import fp8_block_quant
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend, grouped_linear

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_backend_registers_grouped_linear():
    assert "grouped_linear" in backend.ops


@pytest.mark.parametrize("case", cases_for(["grouped_linear"], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(["grouped_linear"], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def _fp8_weight(groups, n, k, gen):
    w = torch.randn(groups * n, k, generator=gen) * k**-0.5
    q, scale = fp8_block_quant(w, (128, 128))
    return q.to(DEVICE), scale.to(DEVICE)


def test_batch_invariance(monkeypatch):
    """Under ``DEEPINFER_BATCH_INVARIANT=1`` a row's output is bitwise identical whatever the
    batch it is projected in (prefill-sized batches included: no bf16 route then)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    gen = torch.Generator().manual_seed(3)
    groups, n, k = (8, 1024, 4096) if HAS_CUDA else (2, 64, 256)
    sizes = (1, 7, 64, 1000) if HAS_CUDA else (1, 7, 33)
    x = torch.randn(max(sizes), groups, k, generator=gen).bfloat16().to(DEVICE)
    w, scale = _fp8_weight(groups, n, k, gen)
    rows = [backend.ops["grouped_linear"](x[:m], w, scale, block_size=(128, 128))[0] for m in sizes]
    for other in rows[1:]:
        assert torch.equal(rows[0], other)


def test_prefill_rows_take_the_bf16_route_and_match_the_kernel(monkeypatch):
    """From ``BF16_ROUTE_TOKENS`` rows (flag off) the batched bf16 GEMM runs; it agrees with the
    Triton kernel (the flag on) to the bf16 rounding of the result."""
    gen = torch.Generator().manual_seed(5)
    groups, n, k = (8, 1024, 4096) if HAS_CUDA else (2, 32, 256)
    x = torch.randn(grouped_linear.BF16_ROUTE_TOKENS, groups, k, generator=gen).bfloat16()
    w, scale = _fp8_weight(groups, n, k, gen)
    calls = []
    route = grouped_linear._bf16_route
    monkeypatch.setattr(grouped_linear, "_bf16_route", lambda *a: calls.append(1) or route(*a))
    fast = backend.ops["grouped_linear"](x.to(DEVICE), w, scale, block_size=(128, 128))
    assert calls == [1] and fast.shape == (x.shape[0], groups, n) and fast.is_contiguous()
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    kernel = backend.ops["grouped_linear"](x.to(DEVICE), w, scale, block_size=(128, 128))
    assert calls == [1]
    torch.testing.assert_close(fast.float(), kernel.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(fast, torch.zeros_like(fast))


def test_rejects_weight_of_the_wrong_width():
    x = torch.randn(2, 2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="grouped_linear weight: expected"):
        backend.ops["grouped_linear"](x, torch.randn(32, 64, device=DEVICE))
