"""The model op families' reference twins against independent transcriptions of the spec
(deepseek-v4.md 2.2-2.8, 7.2), on fresh random inputs; plus the conformance cases of the ops
without another home run against the reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import deepinfer.kernels as K
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.indexer import make_sequences, per_row

GEN = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return torch.randn(shape, generator=GEN) * scale


def test_apply_rope_is_complex_rotation_of_interleaved_tail():
    x, pos = randn(5, 3, 16), torch.arange(5).float()
    freqs = 1.0 / 100 ** (torch.arange(0, 6, 2).float() / 6)
    cos, sin = (pos[:, None] * freqs).cos(), (pos[:, None] * freqs).sin()
    got = K.apply_rope(x, cos, sin)
    tail = torch.view_as_complex(x[..., 10:].reshape(5, 3, 3, 2).contiguous())
    rot = torch.polar(torch.ones(5, 1, 3), (pos[:, None] * freqs)[:, None, :])
    want = torch.cat([x[..., :10], torch.view_as_real(tail * rot).flatten(-2)], -1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(K.apply_rope(got, cos, sin, inverse=True), x, atol=1e-5, rtol=0)


def test_sparse_mqa_sink_equals_dense_softmax_with_sink_column():
    q, kv, sink = randn(4, 3, 8), randn(10, 8), randn(3)
    idx = torch.tensor([[0, 1, -1, 5], [2, 2, 9, -1], [-1, -1, -1, -1], [3, 4, 6, 7]])
    got = K.sparse_mqa_sink(q, kv, idx, sink, 0.35)
    for t in range(4):
        rows = [i for i in idx[t].tolist() if i >= 0]
        for h in range(3):
            if not rows:
                assert torch.all(got[t, h] == 0)
                continue
            logits = torch.cat([0.35 * kv[rows] @ q[t, h], sink[h : h + 1]])
            p = logits.softmax(0)[:-1]
            torch.testing.assert_close(got[t, h], p @ kv[rows])


def test_sparse_mqa_sink_over_sources_equals_the_concatenation():
    """Three sources read in place give bitwise the result of one concatenated tensor, with
    rows listed from every source, holes and duplicates; a bad source is named."""
    q, kv, sink = randn(5, 4, 16), randn(40, 16), randn(4)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 40, (5, 12), generator=g)
    idx[:, :3] = torch.tensor([2, 20, 35])  # one row of each source in every list
    idx[1, 5] = idx[1, 4]
    sources = (kv[:9], kv[9:30].clone(), kv[30:])
    want = K.sparse_mqa_sink(q, kv, idx, sink, 0.3)
    assert torch.equal(K.sparse_mqa_sink(q, sources, idx, sink, 0.3), want)
    assert torch.equal(K.sparse_mqa_sink(q, list(sources), idx.int(), sink, 0.3), want)
    with pytest.raises(ValueError, match=r"kv\[1\]: expected a \[M, 16\] tensor"):
        K.sparse_mqa_sink(q, (kv[:9], kv[9:, :8]), idx, sink, 0.3)
    with pytest.raises(ValueError, match="1..3"):
        K.sparse_mqa_sink(q, (kv,) * 4, idx, sink, 0.3)


def test_hc_coefficients_sinkhorn_and_directions():
    nc, d = 4, 6
    h = randn(3, nc, d)
    fn, base, scale = randn((2 + nc) * nc, nc * d, scale=0.3), randn((2 + nc) * nc), randn(3)
    pre, post, comb = K.hc_mix_coefficients(
        h, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20
    )
    x = h.flatten(1)
    m = (x @ fn.T) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(pre, torch.sigmoid(m[:, :nc] * scale[0] + base[:nc]) + 1e-6)
    torch.testing.assert_close(
        post, 2 * torch.sigmoid(m[:, nc : 2 * nc] * scale[1] + base[nc : 2 * nc])
    )
    # 20 column and 19 row normalisations after the softmax: doubly stochastic to ~eps
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, nc), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, nc), atol=1e-3, rtol=0)
    f = randn(3, d)
    want = post[..., None] * f[:, None] + torch.stack([comb[t].T @ h[t] for t in range(3)])
    torch.testing.assert_close(K.hc_expand(f, h, post, comb), want)
    torch.testing.assert_close(K.hc_collapse(h, pre), (pre[..., None] * h).sum(1))
    head = K.hc_head_coefficients(h, fn[:nc], base[:nc], scale[:1], norm_eps=1e-6, hc_eps=1e-6)
    torch.testing.assert_close(head, torch.sigmoid(m[:, :nc] * scale[0] + base[:nc]) + 1e-6)


def test_hc_coefficients_fp32_order_is_the_ports():
    """Bitwise: the flat streams are normalised, then projected (the public V4 / V4.1
    transformers ports' order); scaling the projection instead rounds differently."""
    nc, d, t = 4, 64, 64
    h, eps = randn(t, nc, d), 1e-20
    fn, base, scale = randn((2 + nc) * nc, nc * d, scale=0.05), randn((2 + nc) * nc), randn(3)
    pre, post, comb = K.hc_mix_coefficients(
        h, fn, base, scale, norm_eps=eps, hc_eps=1e-6, sinkhorn_iters=20
    )
    flat = h.flatten(1)
    m = F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps), fn)
    assert torch.equal(pre, torch.sigmoid(m[:, :nc] * scale[0] + base[:nc]) + 1e-6)
    assert torch.equal(post, 2 * torch.sigmoid(m[:, nc : 2 * nc] * scale[1] + base[nc : 2 * nc]))
    c = torch.softmax((m[:, 2 * nc :] * scale[2] + base[2 * nc :]).view(t, nc, nc), -1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    assert torch.equal(comb, c)
    scaled = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    assert not torch.equal(scaled, m)  # the order is visible in fp32 (so the test can fail)


def test_engram_gate_fp32_order_is_the_ports():
    """Bitwise: the two RMS statistics multiply together before they scale the dot product,
    as in the public V4.1 transformers port."""
    t, nc, d, eps = 64, 4, 64, 1e-20
    h, key, value = randn(t, nc, d), randn(t, nc, d), randn(t, d)
    qw, kw = randn(nc, d) + 1, randn(nc, d) + 1
    mask = torch.ones(t, dtype=torch.bool)
    got = K.engram_gate(h, key, value, qw, kw, mask, eps)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    total = (h * (qw * kw) * key).sum(-1)
    dot = total * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    assert torch.equal(got, h + gate[..., None] * value[:, None, :])
    chained = total * torch.rsqrt(h.square().mean(-1) + eps)
    chained = chained * torch.rsqrt(key.square().mean(-1) + eps) * d**-0.5
    assert not torch.equal(chained, dot)  # the order is visible in fp32


def test_compress_pool_softmax_per_channel_and_missing_slots():
    kv, score = randn(3, 8, 5), randn(3, 8, 5)
    score[0, :4] = float("-inf")  # the first window's previous-window slots do not exist
    got = K.compress_pool(kv, score)
    for e in range(3):
        for d in range(5):
            w = score[e, :, d].softmax(0)
            torch.testing.assert_close(got[e, d], (w * kv[e, :, d]).sum())


@pytest.mark.parametrize(("pool", "step"), [(40, 6), (0, 5), (7, 0)])
@pytest.mark.parametrize("overlap", [False, True])
def test_compress_gather_pool_is_the_pool_of_the_concatenated_rows(pool, step, overlap):
    """Windows from the state pool, the step's rows or both (either source may be empty),
    ``-1`` slots missing: bitwise compress_pool of ``cat([pool, step])[rows]``."""
    g = torch.Generator().manual_seed(pool + step)
    first_kv, first_score = torch.randn(pool, 6, generator=g), torch.randn(pool, 6, generator=g)
    second_kv, second_score = torch.randn(step, 6, generator=g), torch.randn(step, 6, generator=g)
    rows = torch.randint(-1, pool + step, (5, 4), generator=g)
    rows[:, 0] = torch.randint(0, pool + step, (5,), generator=g)
    got = K.compress_gather_pool(first_kv, first_score, second_kv, second_score, rows,
                                 overlap=overlap)  # fmt: skip
    kv = torch.cat([first_kv, second_kv])[rows.clamp(min=0)]
    score = torch.cat([first_score, second_score])[rows.clamp(min=0)]
    score[rows < 0] = float("-inf")
    if overlap:
        kv = torch.cat([kv[:, :2, :3], kv[:, 2:, 3:]], dim=1)
        score = torch.cat([score[:, :2, :3], score[:, 2:, 3:]], dim=1)
    assert torch.equal(got, K.compress_pool(kv, score))


def test_indexer_scores_select_topk_and_padding():
    q, w, keys = randn(2, 4, 8), randn(2, 4), randn(9, 8)
    cand = torch.tensor([[7, 2, 5, -1, -1], [0, 1, 2, 3, 4]])
    seq_rows, q_seq, counts = per_row(cand)
    scores = K.indexer_scores(q, w, keys, seq_rows, q_seq, counts)
    for t in range(2):
        for c in range(5):
            if cand[t, c] < 0:
                assert scores[t, c] == float("-inf")
            else:
                want = (w[t] * (q[t] @ keys[cand[t, c]]).relu()).sum()
                torch.testing.assert_close(scores[t, c], want)
    picked = K.select_topk(scores, seq_rows, q_seq, 4)
    assert picked[0, 3] == -1  # only three candidates
    for t in range(2):
        valid = [c for c in range(5) if cand[t, c] >= 0]
        best = sorted(valid, key=lambda c: -scores[t, c].item())[:4]
        assert picked[t, : len(best)].tolist() == [cand[t, c].item() for c in best]


def test_indexer_ops_on_sequence_lists_equal_each_querys_own_list():
    """Queries sharing a sequence's list, each seeing its first ``counts[t]`` columns, score
    and pick exactly as with each query's own ``-1``-padded list."""
    g = torch.Generator().manual_seed(5)
    q, w, keys = randn(9, 4, 8), randn(9, 4), randn(40, 8)
    seq_rows, q_seq, counts = make_sequences(g, rows=9, width=12, num_keys=40, sequences=3)
    cols = torch.arange(12)
    own = seq_rows[q_seq].masked_fill(cols >= counts[:, None], -1)
    scores = K.indexer_scores(q, w, keys, seq_rows, q_seq, counts)
    assert torch.equal(scores, K.indexer_scores(q, w, keys, *per_row(own)))
    picked = K.select_topk(scores, seq_rows, q_seq, 5)
    assert torch.equal(picked, K.select_topk(scores, *per_row(own)[:2], 5))


def test_candidate_block_mask_forces_newest_block():
    scores = torch.tensor([[5.0, 1.0, 0.5, 0.2, 9.0, 0.1, -7.0, float("-inf")]])
    counts = torch.tensor([7])  # entries 0..6 visible; the newest (6) sits in block 3
    mask = K.candidate_block_mask(scores, counts, 2, 2)
    # block scores: [5, 0.5, 9, -7(forced)] -> keep the newest block and the best other (2)
    assert mask.tolist() == [[False, False, False, False, True, True, True, True]]


def test_hadamard_rotate_is_orthonormal_sylvester():
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x = randn(3, 16)
    torch.testing.assert_close(K.hadamard_rotate(x), x @ h / 4)


def test_route_topk_bias_selects_but_does_not_weight():
    logits = randn(4, 6)
    bias = torch.tensor([0.0, 0, 0, 0, 0, 100.0])  # forces expert 5 into every selection
    w, ids = K.route_topk(
        logits,
        bias,
        2,
        scoring_func="sqrtsoftplus",
        route_scale=1.5,
        norm_eps=0.0,
        renormalize=True,
    )
    s = F.softplus(logits).sqrt()
    assert torch.all((ids == 5).any(-1))
    other = s[:, :5].argmax(-1)
    for t in range(4):
        pair = {5: s[t, 5], other[t].item(): s[t, other[t]]}
        total = sum(pair.values())
        for j in range(2):
            torch.testing.assert_close(w[t, j], 1.5 * pair[ids[t, j].item()] / total)
    hw = K.route_hash(
        logits, ids, scoring_func="sqrtsoftplus", route_scale=1.5, norm_eps=0.0, renormalize=True
    )
    torch.testing.assert_close(hw, w)


def test_swiglu_clamps_gate_above_and_up_both_sides():
    g, u = randn(5, 7, scale=20), randn(5, 7, scale=20)
    want = F.silu(g.clamp(max=10)) * u.clamp(-10, 10)
    torch.testing.assert_close(K.swiglu_clamped(g, u, 10.0), want)


def test_linear_fp8_and_fp4_equal_dense_of_dequantised_weight():
    x = randn(3, 256)
    w = randn(64, 256, scale=0.1)
    q, s = K.fp8_block_quant(w, (128, 128))
    dense = K.fp8_block_dequant(q, s, (128, 128), out_dtype=torch.float32)
    torch.testing.assert_close(K.linear(x, q, s, block_size=(128, 128)), x @ dense.T)
    packed, s4 = K.fp4_quant(w, 32)
    dense4 = K.fp4_dequant(packed, s4, 32, out_dtype=torch.float32)
    torch.testing.assert_close(K.linear(x, packed, s4), x @ dense4.T)
    # activation-quant simulation rounds the input, nothing else
    sim = K.linear(x, q, s, block_size=(128, 128), act_quant_group=128)
    torch.testing.assert_close(sim, K.fp8_sim(x, 128) @ dense.T)
    assert not torch.equal(sim, x @ dense.T)


def test_grouped_linear_is_block_diagonal():
    x, w = randn(4, 3, 8), randn(3 * 5, 8)
    got = K.grouped_linear(x, w)
    want = torch.stack([x[:, g] @ w[g * 5 : (g + 1) * 5].T for g in range(3)], 1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "case",
    cases_for(
        ["select_topk", "candidate_block_mask", "hadamard_rotate", "grouped_linear"], "small"
    ),
    ids=str,
)
def test_conformance_cases_run_on_the_reference(case):
    check_case(K.OPS[case.op].reference, case, device="cpu")
    assert not math.isnan(case.atol)
