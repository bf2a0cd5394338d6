"""The fused mHC pre stage (coefficients + collapse in one launch) against the reference ops."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels_nvidia.hc_pre import HcPreTiles, hc_pre

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
KW = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}


def _args(tokens, dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 4 * dim
    x = (torch.randn(tokens, 4, dim, generator=g) * 3).to(dtype).to(DEVICE)
    fn = (torch.randn(24, width, generator=g) * width**-0.5).to(DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    return x, fn, base, scale


def _check_against_reference(x, fn, base, scale, tiles=None):
    y, pre, post, comb = hc_pre(x, fn, base, scale, tiles=tiles, **KW)
    want = kernels.OPS["hc_mix_coefficients"].reference(x, fn, base, scale, **KW)
    for got, ref in zip((pre, post, comb), want):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    # The collapse with the fused kernel's own weights: at most a rounding step of x.dtype.
    want_y = kernels.OPS["hc_collapse"].reference(x, pre)
    torch.testing.assert_close(y.float(), want_y.float(), atol=1e-2, rtol=8e-3)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], x.shape[2])


@pytest.mark.parametrize(
    "tokens,dim,dtype",
    [(9, 64, torch.bfloat16), (20, 96, torch.bfloat16), (5, 48, torch.float32),
     (3, 64, torch.float16)],
    ids=str,
)  # fmt: skip
def test_fused_pre_matches_reference_small(tokens, dim, dtype):
    _check_against_reference(*_args(tokens, dim, dtype, seed=tokens))


def test_zero_tokens_and_bad_shapes():
    x, fn, base, scale = _args(0, 64)
    y, pre, post, comb = hc_pre(x, fn, base, scale, **KW)
    assert y.shape == (0, 64) and comb.shape == (0, 4, 4)
    x, fn, base, scale = _args(2, 64)
    with pytest.raises(ValueError, match="fn: expected shape"):
        hc_pre(x, fn[:, :64], base, scale, **KW)
    with pytest.raises(ValueError, match="x: expected"):
        hc_pre(x[:, :2], fn, base, scale, **KW)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens,dim", [(1, 4096), (77, 4096), (1000, 5120), (4096, 4096)])
def test_fused_pre_matches_reference_real(tokens, dim):
    _check_against_reference(*_args(tokens, dim, seed=tokens))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiles", [HcPreTiles(32, 64, 4), HcPreTiles(16, 256, 8)], ids=str)
def test_fused_pre_other_tiles(tiles):
    _check_against_reference(*_args(300, 5120, seed=5), tiles=tiles)


@pytest.mark.gpu
@gpu
def test_fused_pre_batch_invariant_and_repeatable():
    x, fn, base, scale = _args(64, 4096, seed=11)
    firsts = [hc_pre(x[:n], fn, base, scale, **KW) for n in (1, 7, 64)]
    again = hc_pre(x, fn, base, scale, **KW)
    for other in (*firsts[1:], again):
        for a, b in zip(other, firsts[0]):
            assert torch.equal(a[:1], b[:1])
