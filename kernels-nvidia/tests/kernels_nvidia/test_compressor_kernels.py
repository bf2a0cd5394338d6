"""Compressor softmax-pool kernel against the reference through the conformance kit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("case", cases_for(["compress_pool"], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(["compress_pool"], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def test_single_row_window_is_the_row():
    kv = torch.randn(7, 1, 64, device=DEVICE)
    score = torch.randn(7, 1, 64, device=DEVICE)
    assert torch.equal(backend.ops["compress_pool"](kv, score), kv[:, 0])


def test_rejects_mismatched_score():
    kv = torch.randn(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="score: expected shape"):
        backend.ops["compress_pool"](kv, kv[:, :2])


def test_narrow_results_round_as_a_separate_cast():
    """``out_dtype`` rounds the fp32 pool exactly as ``.to`` does (bf16 in the kernel)."""
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(9, 8, 96, generator=gen).to(DEVICE)
    score = torch.randn(9, 8, 96, generator=gen).to(DEVICE)
    score[:, :3, :5] = float("-inf")
    pool = backend.ops["compress_pool"]
    wide = pool(kv, score)
    for dtype in (torch.bfloat16, torch.float16):
        narrow = pool(kv, score, out_dtype=dtype)
        assert narrow.dtype == dtype and torch.equal(narrow, wide.to(dtype))
