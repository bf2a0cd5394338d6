"""mHC Triton kernels (coefficients with Sinkhorn, collapse, expand) against the reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
OPS = ["hc_mix_coefficients", "hc_head_coefficients", "hc_collapse", "hc_expand", "hc_pre"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_backend_registers_the_hc_kernels():
    assert set(OPS) <= set(backend.ops)


@pytest.mark.parametrize("case", cases_for(OPS, "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS, "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def _coeff_args(tokens, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 4 * dim
    x = (torch.randn(tokens, 4, dim, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    fn = (torch.randn(24, width, generator=g) * width**-0.5).to(DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    return x, fn, base, scale


def test_comb_is_doubly_stochastic_after_sinkhorn():
    x, fn, base, scale = _coeff_args(9, 64)
    _, _, comb = backend.ops["hc_mix_coefficients"](
        x, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20
    )
    ones = torch.ones(9, 4, device=DEVICE)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), ones, atol=2e-2, rtol=0)


def test_batch_invariance():
    dim = 4096 if HAS_CUDA else 320
    x, fn, base, scale = _coeff_args(64, dim, seed=1)
    kw = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
    firsts = [backend.ops["hc_mix_coefficients"](x[:n], fn, base, scale, **kw) for n in (1, 7, 64)]
    for other in firsts[1:]:
        for a, b in zip(other, firsts[0]):
            assert torch.equal(a[:1], b[:1])


def test_rejects_bad_shapes():
    x, fn, base, scale = _coeff_args(2, 64)
    kw = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 3}
    with pytest.raises(ValueError, match="fn: expected shape"):
        backend.ops["hc_mix_coefficients"](x, fn[:, :64], base, scale, **kw)
    with pytest.raises(ValueError, match="f: expected shape"):
        post, comb = torch.rand(2, 4, device=DEVICE), torch.rand(2, 4, 4, device=DEVICE)
        backend.ops["hc_expand"](x[:, 0, :32], x, post, comb)
