"""The mHC pre site ``hc_pre`` (coefficients + collapse, one pass over the streams where the
collapse weights are given) against the reference and the two-op path.

Tolerances: the coefficients are fp32 sums over 4 D products in another order than the
reference's (atol 2e-5, rtol 1e-5 on values of magnitude ~1); ``y`` is rounded to the streams'
dtype, so it may differ by one rounding step of that dtype (bf16: 2^-8 relative) when the fp32
sums differ in their last bits.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels_nvidia import backend
from deepinfer.kernels_nvidia.hc_pre import HcPreTiles, hc_pre

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
KW = {"norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}
Y_TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}


def _args(tokens, dim, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 4 * dim
    x = (torch.randn(tokens, 4, dim, generator=g) * 3).to(dtype).to(DEVICE)
    fn = (torch.randn(24, width, generator=g) * width**-0.5).to(DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    given = (torch.rand(tokens, 4, generator=g) + 0.1).to(DEVICE)
    return x, fn, base, scale, given


def _check(x, fn, base, scale, given, deferred, tiles=None):
    collapse_pre = given if deferred else None
    y, pre, post, comb = hc_pre(x, fn, base, scale, collapse_pre=collapse_pre, tiles=tiles, **KW)
    want = kernels.OPS["hc_mix_coefficients"].reference(x, fn, base, scale, **KW)
    two_op = backend.ops["hc_mix_coefficients"](x, fn, base, scale, **KW)
    for got, ref, other in zip((pre, post, comb), want, two_op):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got, other, atol=2e-5, rtol=1e-5)
    # The collapse with the weights it used: at most one rounding step of x.dtype.
    want_y = kernels.OPS["hc_collapse"].reference(x, given if deferred else pre)
    tol = Y_TOL[x.dtype]
    torch.testing.assert_close(y.float(), want_y.float(), atol=tol, rtol=tol)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], x.shape[2])


@pytest.mark.parametrize("deferred", [False, True], ids=["v4", "deferred"])
@pytest.mark.parametrize(
    "tokens,dim,dtype,tiles",
    [(9, 64, torch.bfloat16, None), (70, 96, torch.bfloat16, HcPreTiles(16, 32, 4, 16, 2)),
     (5, 48, torch.float32, HcPreTiles(16, 32, 4, 16, 2)), (3, 64, torch.float16, None),
     (40, 96, torch.bfloat16, HcPreTiles(16, 32, 4, 16, 2, True))],
    ids=str,
)  # fmt: skip
def test_pre_matches_reference_small(tokens, dim, dtype, tiles, deferred):
    _check(*_args(tokens, dim, dtype, seed=tokens), deferred, tiles)


def test_zero_tokens_and_bad_shapes():
    x, fn, base, scale, given = _args(0, 64)
    y, pre, post, comb = hc_pre(x, fn, base, scale, **KW)
    assert y.shape == (0, 64) and comb.shape == (0, 4, 4)
    x, fn, base, scale, given = _args(2, 64)
    with pytest.raises(ValueError, match="fn: expected shape"):
        hc_pre(x, fn[:, :64], base, scale, **KW)
    with pytest.raises(ValueError, match="x: expected"):
        hc_pre(x[:, :2], fn, base, scale, **KW)
    with pytest.raises(ValueError, match="collapse_pre: expected shape"):
        hc_pre(x, fn, base, scale, collapse_pre=given[:1], **KW)
    with pytest.raises(ValueError, match="block_cols"):
        hc_pre(x, fn, base, scale, tiles=HcPreTiles(16, 48, 4, 32, 2), **KW)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("deferred", [False, True], ids=["v4", "deferred"])
@pytest.mark.parametrize("tokens,dim", [(1, 4096), (77, 4096), (1000, 5120), (4096, 4096)])
def test_pre_matches_reference_real(tokens, dim, deferred):
    _check(*_args(tokens, dim, seed=tokens), deferred)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "tiles",
    [
        HcPreTiles(32, 256, 4, 32, 3),
        HcPreTiles(64, 1024, 8, 16, 4),
        HcPreTiles(32, 512, 8, 16, 4, True),
    ],
    ids=str,
)
def test_pre_other_tiles(tiles):
    _check(*_args(300, 5120, seed=5), True, tiles)


@pytest.mark.parametrize("deferred", [False, True], ids=["v4", "deferred"])
def test_pre_batch_invariant_and_repeatable(deferred):
    """A token's outputs are bitwise the same alone, in a batch of 7 or 64, and run again."""
    dim = 4096 if HAS_CUDA else 96
    x, fn, base, scale, given = _args(64, dim, seed=11)

    def run(n):
        return hc_pre(x[:n], fn, base, scale, collapse_pre=given[:n] if deferred else None, **KW)

    firsts = [run(n) for n in (1, 7, 64)]
    for other in (*firsts[1:], run(64)):
        for a, b in zip(other, firsts[0]):
            assert torch.equal(a[:1], b[:1])
