"""Lightning-indexer scoring kernel and top-k selection against the reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.indexer import make_candidates, make_sequences, per_row
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_backend_registers_the_indexer_kernels():
    assert {"indexer_scores", "select_topk"} <= set(backend.ops)


OPS = ["indexer_scores", "select_topk", "hadamard_rotate", "candidate_block_mask"]


@pytest.mark.parametrize("case", cases_for(OPS, "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS, "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.parametrize(
    "width,k", [(40, 16), (40, 64), (1000, 512), (16384, 512), (20000, 512)], ids=str
)
def test_select_topk_picks_the_same_set(width, k):
    g = torch.Generator().manual_seed(width + k)
    # all-positive, all-negative and random rows; the interpreter takes one random row of the
    # widest shapes (each row costs it seconds per width of 1,000)
    rows = 6 if HAS_CUDA or width <= 1000 else 3
    cand = make_candidates(g, rows=rows, width=width, num_keys=10 * width).to(DEVICE)
    scores = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 100
    scores[0] = scores[0].abs()  # all positive
    scores[1] = -scores[1].abs()  # all negative
    scores = scores.to(DEVICE).masked_fill(cand < 0, float("-inf"))
    lists = per_row(cand)[:2]
    got = backend.ops["select_topk"](scores, *lists, k)
    want = kernels.OPS["select_topk"].reference(scores, *lists, k)
    assert got.shape == want.shape == (rows, k) and got.dtype == torch.int64
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)  # the same winners
    assert torch.equal(got, want)  # and the reference's order (ties: lowest column first)
    positions = torch.arange(width, device=DEVICE).expand(rows, -1).masked_fill(cand < 0, -1)
    picked = backend.ops["select_topk"](scores, *per_row(positions)[:2], k)
    picked_scores = scores.gather(-1, picked.clamp(min=0)).masked_fill(picked < 0, -float("inf"))
    assert (picked_scores[:, :-1] >= picked_scores[:, 1:]).all()  # descending (ties any order)


def test_wide_rows_sort_in_blocks_of_rows_with_the_same_result(monkeypatch):
    """The sort for rows wider than two selections take runs a block of rows at a time
    (bounded memory for long prompts); the picks equal the reference's, row for row."""
    from deepinfer.kernels_nvidia import indexer_topk

    g = torch.Generator().manual_seed(7)
    rows, width, k = 7, 20000, 512
    cand = make_candidates(g, rows=rows, width=width, num_keys=10 * width).to(DEVICE)
    scores = (torch.randn(rows, width, generator=g) * 10).round().to(DEVICE)  # many ties
    scores = scores.masked_fill(cand < 0, float("-inf"))
    monkeypatch.setattr(indexer_topk, "SORT_BLOCK_ELEMENTS", 2 * width)  # blocks of 2 rows
    sorted_rows, sort_rows = [], indexer_topk._topk_rows
    monkeypatch.setattr(indexer_topk, "_topk_rows",
                        lambda s, *a: sorted_rows.append(len(s)) or sort_rows(s, *a))  # fmt: skip
    lists = per_row(cand)[:2]
    got = indexer_topk._topk_torch(scores, *lists, k)
    assert sorted_rows == [2, 2, 2, 1]
    assert torch.equal(got, kernels.OPS["select_topk"].reference(scores, *lists, k))


@pytest.mark.parametrize("width,k", [(16385, 7), (32800, 300)], ids=str)
def test_wide_rows_take_two_selections_with_the_sorts_result(monkeypatch, width, k):
    """Rows wider than the kernel takes: each segment's k best, then the best of those; ties
    (many, from rounded scores) still go to the lowest column, as in one stable sort."""
    from deepinfer.kernels_nvidia import indexer_topk

    g = torch.Generator().manual_seed(width)
    rows = 3
    cand = make_candidates(g, rows=rows, width=width, num_keys=10 * width).to(DEVICE)
    scores = (torch.randn(rows, width, generator=g) * 4).round().to(DEVICE)
    scores[2, : width // 2] = float("-inf")  # a row whose first segment is all holes
    scores = scores.masked_fill(cand < 0, float("-inf"))
    monkeypatch.setattr(indexer_topk, "_topk_torch", None)  # the sort is not taken
    got = backend.ops["select_topk"](scores, *per_row(cand)[:2], k)
    assert torch.equal(got, kernels.OPS["select_topk"].reference(scores, *per_row(cand)[:2], k))


def test_select_topk_ties_and_short_rows():
    """Equal scores at the threshold fill exactly the places left; short rows pad with -1."""
    scores = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.5, 2.0], [1.0, -float("inf"), 2.0, 0, 0, 0]])
    scores[1, 3:] = float("-inf")
    cand = torch.arange(12).view(2, 6) + 100
    got = backend.ops["select_topk"](scores.to(DEVICE), *per_row(cand.to(DEVICE))[:2], 4).cpu()
    assert got[0].tolist() == [100, 105, 101, 102]  # ties: lower column first
    assert got[1].tolist() == [108, 106, -1, -1]


def test_no_candidates_yet_gives_only_holes():
    """A step before the first compressed entry has zero-width scores (seen on the H200 in the
    engine's step-cost profile): every pick is a hole, as in the reference."""
    scores = torch.empty(3, 0, device=DEVICE)
    cand = torch.empty(3, 0, dtype=torch.int64, device=DEVICE)
    got = backend.ops["select_topk"](scores, *per_row(cand)[:2], 8)
    want = kernels.OPS["select_topk"].reference(scores, *per_row(cand)[:2], 8)
    assert got.shape == want.shape == (3, 8) and torch.equal(got.cpu(), want.cpu())
    assert (got == -1).all()
    mask = backend.ops["candidate_block_mask"](scores, torch.zeros(3, dtype=torch.long), 4, 2)
    assert mask.shape == (3, 0) and mask.dtype == torch.bool


def test_select_topk_many_zero_scores_break_ties_by_column():
    """After the ReLU many scores are exactly 0 (or -0.0): the choice and order among them
    follow a stable descending sort, whatever padding follows."""
    g = torch.Generator().manual_seed(7)
    rows, width, k = 5, 300, 64
    scores = torch.randn(rows, width, generator=g).relu() * (torch.rand(rows, 1, generator=g) - 0.5)
    scores[:, ::7] = -0.0
    cand = torch.randperm(10 * width, generator=g)[:width]  # one sequence's list, every row's
    q_seq = torch.zeros(rows, dtype=torch.long, device=DEVICE)
    got = backend.ops["select_topk"](scores.to(DEVICE), cand[None].to(DEVICE), q_seq, k).cpu()
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(got, cand[order])


def test_scores_are_batch_invariant():
    g = torch.Generator().manual_seed(3)
    heads, dim, width = (64, 128, 16384) if HAS_CUDA else (16, 32, 100)
    q = torch.randn(64, heads, dim, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(64, heads, generator=g).to(DEVICE)
    keys = torch.randn(width, dim, generator=g).bfloat16().to(DEVICE)
    seq_rows, q_seq, counts = (x.to(DEVICE) for x in make_sequences(
        g, rows=64, width=width, num_keys=width, sequences=4))  # fmt: skip
    fn = backend.ops["indexer_scores"]
    outs = [fn(q[:n], w[:n], keys, seq_rows, q_seq[:n], counts[:n])[:1] for n in (1, 7, 64)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_weights_scaled_in_the_op_equal_weights_scaled_first():
    """bf16 per-head weights with ``weight_scale`` score bit for bit as the fp32 weights
    ``weights.float() * weight_scale`` (the model's former cast and multiply), the reference
    too."""
    g = torch.Generator().manual_seed(4)
    heads, dim, width = (64, 128, 4096) if HAS_CUDA else (16, 32, 100)
    q = torch.randn(9, heads, dim, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(9, heads, generator=g).bfloat16().to(DEVICE)
    keys = torch.randn(width, dim, generator=g).bfloat16().to(DEVICE)
    lists = [x.to(DEVICE) for x in make_sequences(g, rows=9, width=width, num_keys=width,
                                                  sequences=2)]  # fmt: skip
    scale = (dim * heads) ** -0.5
    for fn in (backend.ops["indexer_scores"], kernels.OPS["indexer_scores"].reference):
        got = fn(q, w, keys, *lists, weight_scale=scale)
        assert torch.equal(got, fn(q, w.float() * scale, keys, *lists))


def test_rejects_bad_shapes():
    q = torch.randn(2, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weights: expected shape"):
        backend.ops["indexer_scores"](q, q[:, :, 0].t(), q[0], *per_row(torch.zeros(2, 3).long()))


def test_candidate_blocks_tie_rule_and_newest_block():
    """Equal block maxima keep the earlier block; the newest visible block is always kept;
    blocks with nothing visible never are."""
    g = torch.Generator().manual_seed(11)
    rows, width, block, keep_blocks = 4, 70, 4, 5
    counts = torch.tensor([70, 33, 3, 0])
    scores = torch.randn(rows, width, generator=g).relu().round()  # many equal maxima
    scores[torch.arange(width)[None, :] >= counts[:, None]] = -float("inf")
    got = backend.ops["candidate_block_mask"](
        scores.to(DEVICE), counts.to(DEVICE), keep_blocks, block
    )
    got = got.cpu()
    for r in range(rows):
        maxima = torch.nn.functional.pad(scores[r], (0, -width % block), value=-float("inf"))
        maxima = maxima.view(-1, block).amax(-1)
        if counts[r] > 0:
            maxima[(counts[r] - 1) // block] = float("inf")
        order = torch.sort(maxima, descending=True, stable=True)
        kept = order.indices[:keep_blocks][order.values[:keep_blocks] > -float("inf")]
        want = torch.zeros(maxima.shape[0], dtype=torch.bool)
        want[kept] = True
        assert torch.equal(got[r], want.repeat_interleave(block)[:width]), r


@pytest.mark.parametrize("keys_as_m", [False, True], ids=["heads_as_m", "keys_as_m"])
def test_scores_launch_variants_match_reference(keys_as_m):
    """Several blocks per program, a ragged last block, holes: both product orientations."""
    g = torch.Generator().manual_seed(21)
    rows, heads, dim, width = 3, 16, 32, 150
    q = torch.randn(rows, heads, dim, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(rows, heads, generator=g).to(DEVICE)
    keys = torch.randn(400, dim, generator=g).bfloat16().to(DEVICE)
    lists = [x.to(DEVICE) for x in make_sequences(g, rows=rows, width=width, num_keys=400,
                                                   sequences=2)]  # fmt: skip
    got = backend.ops["indexer_scores"](
        q, w, keys, *lists, block_c=32, blocks_per_program=2, num_warps=4, keys_as_m=keys_as_m
    )
    want = kernels.OPS["indexer_scores"].reference(q, w, keys, *lists)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dim", [32, 128])
def test_packed_fp4_keys_score_bitwise_like_their_values(dim):
    """Keys in the cache's FP4 rows (:class:`PackedRows`) decoded in the kernel give the scores
    of the same values stored as a float tensor, bit for bit; and match the reference."""
    fmt = kernels.RowFormat(dim, dim, "e2m1", 32, "ue8m0")
    g = torch.Generator().manual_seed(8)
    rows, heads = 5, 16
    q = torch.randn(rows, heads, dim, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(rows, heads, generator=g).to(DEVICE)
    raw = torch.randn(300, dim, generator=g) * torch.exp(torch.randn(300, 1, generator=g) * 3)
    data = kernels.OPS["pack_rows"].reference(raw, fmt).to(DEVICE)
    values = kernels.OPS["unpack_rows"].reference(data, fmt, torch.bfloat16)
    cand = per_row(make_candidates(g, rows=rows, width=90, num_keys=300).to(DEVICE))
    fn = backend.ops["indexer_scores"]
    got = fn(q, w, kernels.PackedRows(data, fmt), *cand)
    assert torch.equal(got, fn(q, w, values, *cand))
    want = kernels.OPS["indexer_scores"].reference(q, w, kernels.PackedRows(data, fmt), *cand)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("launch", [{}, {"block_c": 16, "blocks_per_program": 2}], ids=str)
def test_causal_prefill_counts_score_bitwise_like_the_reference(dtype, launch):
    """A fresh causal prefill of two sequences (counts ``(position + 1) // 4``): most programs
    and blocks lie wholly past their row's count, and are skipped. Small integer inputs make
    every sum exact, so the scores (and the ``-inf`` past each count) equal the reference's
    bit for bit."""
    g = torch.Generator().manual_seed(24)
    lens, ratio, heads, dim = (200, 56), 4, 16, 32
    positions = torch.cat([torch.arange(n) for n in lens])
    q_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    counts = (positions + 1) // ratio
    width = int(counts.max())
    seq_rows = torch.arange(len(lens) * width).view(len(lens), width)  # the arena, in order
    seq_rows[torch.arange(width)[None, :] >= torch.tensor(lens)[:, None] // ratio] = -1
    q = torch.randint(-2, 3, (len(q_seq), heads, dim), generator=g).to(dtype)
    w = torch.randint(-3, 4, (len(q_seq), heads), generator=g).float()
    keys = torch.randint(-2, 3, (seq_rows.numel(), dim), generator=g).to(dtype)
    args = [x.to(DEVICE) for x in (q, w, keys, seq_rows.int(), q_seq, counts)]
    got = backend.ops["indexer_scores"](*args, **launch).cpu()
    want = kernels.OPS["indexer_scores"].reference(*args).cpu()
    past = torch.arange(width)[None, :] >= counts[:, None]
    assert got[past].isneginf().all() and got[~past].isfinite().all()
    assert torch.equal(got, want)
