"""The radix-select top-k kernel (indexer_select) in every launch variant against the
reference: compaction after a few passes or none, digit widths; rows with ties, ``-inf`` holes, fewer than k finite scores,
none at all, all equal; widths that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def _hard_rows(gen: torch.Generator, rows: int, width: int, k: int) -> torch.Tensor:
    """Fresh random scores with the awkward rows first (each row its own case)."""
    scale = torch.rand(rows, 1, generator=gen) * 10
    scores = torch.randn(rows, width, generator=gen) * scale
    scores[0] = (scores[0] * 4).round().relu()  # ReLU zeros and integer ties: tie overflow
    scores[1, ::3] = -float("inf")  # holes
    scores[2, k // 2 :] = -float("inf")  # fewer than k finite scores
    scores[3] = -float("inf")  # nothing to choose
    scores[4] = 1.5  # all equal: the lowest columns win
    scores[5] = scores[5] * 1e-4 + 3.0  # one narrow band: many passes share the top bits
    scores[6, ::7] = -0.0  # ties with +0.0
    scores[6, 1::7] = 0.0
    return scores


def _check(width: int, k: int, seed: int, **launch) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = 9
    scores = _hard_rows(gen, rows, width, k).to(DEVICE)
    # two sequences' lists of distinct rows; the rows alternate between them
    seq_rows = torch.randperm(6 * width, generator=gen)[: 2 * width].view(2, width).to(DEVICE)
    q_seq = (torch.arange(rows) % 2).to(DEVICE)
    got = backend.ops["select_topk"](scores, seq_rows, q_seq, k, **launch)
    want = kernels.OPS["select_topk"].reference(scores, seq_rows, q_seq, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    mismatch = (got != want).any(-1).nonzero().flatten().tolist()
    assert not mismatch, f"rows {mismatch} differ ({launch})"


LAUNCHES = [
    {"digit": 5, "cap": 64},  # compaction after the first passes
    {"digit": 4, "cap": 16},
    {"digit": 6, "cap": 256},
    {"digit": 8, "cap": 4096},  # no compaction (cap >= the row)
]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda d: "-".join(f"{v}" for v in d.values()))
def test_select_variants_match_reference(launch):
    _check(700, 64, seed=launch["digit"] + launch["cap"], num_warps=4, **launch)


@pytest.mark.parametrize("width,k", [(1, 4), (5, 8), (37, 16), (130, 128)], ids=str)
def test_select_narrow_rows(width, k):
    """Rows narrower than or close to k (the engine asks with every visible count)."""
    _check(width, k, seed=width)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("width", [16384, 10000], ids=str)
@pytest.mark.parametrize("launch", LAUNCHES + [{}], ids=lambda d: str(sorted(d.items())))
def test_select_model_widths(width, launch):
    _check(width, 512, seed=width, **launch)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("width,k", [(3001, 512), (16384, 2048), (16383, 64)], ids=str)
def test_select_other_shapes(width, k):
    _check(width, k, seed=width + k)


@pytest.mark.gpu
@gpu
def test_select_is_batch_invariant_and_repeatable():
    """A row's picks never depend on the other rows, nor change between calls."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(64, 16384, generator=gen).relu().to(DEVICE)
    cand, q_seq = torch.arange(16384, device=DEVICE)[None], torch.zeros(64, dtype=torch.long)
    q_seq = q_seq.to(DEVICE)
    fn = backend.ops["select_topk"]
    full = fn(scores, cand, q_seq, 512)
    for n in (1, 7, 64):
        assert torch.equal(fn(scores[:n], cand, q_seq[:n], 512), full[:n])
    assert all(torch.equal(fn(scores, cand, q_seq, 512), full) for _ in range(5))
