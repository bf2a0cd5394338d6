"""DEEPINFER_BATCH_INVARIANT=1 on the reference backend: a row's result is bitwise the same
alone and inside batches of other rows (with more index-list padding)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels as K
from deepinfer.kernels.testing.cases.indexer import per_row


@pytest.fixture(autouse=True)
def _invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _rows(g, n, *shape):
    return torch.randn(n, *shape, generator=g)


def test_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    x, w = _rows(g, 41, 96), torch.randn(160, 96, generator=g)
    batched = K.linear(x, w)
    for i in (0, 17, 40):
        assert torch.equal(batched[i : i + 1], K.linear(x[i : i + 1], w))
        assert torch.equal(batched[i : i + 1], K.linear(x[i : i + 7], w)[:1])
    torch.testing.assert_close(batched, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_sparse_attention_ignores_padding_width():
    g = torch.Generator().manual_seed(1)
    q, kv, sink = _rows(g, 6, 4, 32), torch.randn(50, 32, generator=g), torch.randn(4, generator=g)
    idx = torch.randint(0, 50, (6, 9), generator=g)
    idx[2, 3:] = -1
    idx[4, :] = -1
    wide = torch.cat([idx, torch.full((6, 23), -1)], dim=1)  # more padding, as a bigger batch has
    narrow = K.sparse_mqa_sink(q[2:3], kv, idx[2:3, :3], sink, 0.1)
    assert torch.equal(K.sparse_mqa_sink(q, kv, wide, sink, 0.1)[2:3], narrow)
    assert torch.equal(K.sparse_mqa_sink(q, kv, idx, sink, 0.1)[4], torch.zeros(4, 32))


def test_indexer_scores_restore_padding_columns():
    g = torch.Generator().manual_seed(2)
    q, w, keys = _rows(g, 3, 4, 16), _rows(g, 3, 4), torch.randn(30, 16, generator=g)
    cand = torch.randint(0, 30, (3, 8), generator=g)
    cand[1, 5:] = -1
    scores = K.indexer_scores(q, w, keys, *per_row(cand))
    assert torch.isinf(scores[1, 5:]).all() and torch.isfinite(scores[1, :5]).all()
    alone = K.indexer_scores(q[1:2], w[1:2], keys, *per_row(cand[1:2, :5]))
    assert torch.equal(scores[1:2, :5], alone)


@pytest.mark.parametrize("deferred", [False, True], ids=["v4", "v41-deferred"])
def test_hc_pre_rows_do_not_depend_on_the_batch(deferred):
    """The fused mHC pre site runs row by row like its two component ops (``collapse_pre``,
    V4.1's deferred weights, split with the rows when given)."""
    g = torch.Generator().manual_seed(4)
    nc, dim, rows = 4, 48, 11
    x = _rows(g, rows, nc, dim).to(torch.bfloat16)
    fn = torch.randn((2 + nc) * nc, nc * dim, generator=g) * dim**-0.5
    base, scale = torch.randn((2 + nc) * nc, generator=g), torch.rand(3, generator=g) + 0.5
    collapse_pre = torch.rand(rows, nc, generator=g) if deferred else None
    args = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)

    def site(lo, hi):
        pre = None if collapse_pre is None else collapse_pre[lo:hi]
        return K.hc_pre(x[lo:hi], fn, base, scale, collapse_pre=pre, **args)

    batched = site(0, rows)
    for i in (0, 6, 10):
        for alone, full in zip(site(i, i + 1), batched, strict=True):
            assert torch.equal(alone, full[i : i + 1])
    pre, post, comb = K.hc_mix_coefficients(x, fn, base, scale, **args)
    y = K.hc_collapse(x, pre if collapse_pre is None else collapse_pre)
    for got, want in zip(batched, (y, pre, post, comb), strict=True):
        assert torch.equal(got, want)


def test_outputs_match_the_plain_reference_numerically(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x, weight = _rows(g, 9, 64), torch.rand(64, generator=g) + 0.5
    invariant = K.rms_norm(x, weight, 1e-6)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    torch.testing.assert_close(invariant, K.rms_norm(x, weight, 1e-6))
