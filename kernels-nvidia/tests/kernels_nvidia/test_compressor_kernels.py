"""Compressor softmax-pool kernels against the reference through the conformance kit, and the
gathering kernel against the plain one on the windows it gathers."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize(
    "case",
    cases_for(["compress_pool", "compress_gather_pool", "write_state_rows"], "small"),
    ids=str,
)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "case",
    cases_for(["compress_pool", "compress_gather_pool", "write_state_rows"], "real"),
    ids=str,
)
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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_dtype", [torch.float32], ids=str)
def test_gathered_windows_pool_bitwise_as_the_plain_kernel(overlap, out_dtype, step_dtype):
    """``compress_gather_pool`` equals ``compress_pool`` of the windows gathered by torch (the
    model's path before the fused op) bit for bit: same tile and arithmetic, rows from the state
    pool, from the step and missing (-1) alike; bf16 step rows as their widened fp32 values."""
    gen = torch.Generator().manual_seed(11)
    entries, window, width, pool, step = 9, 8 if overlap else 16, 96, 21, 17
    sources = [torch.randn(n, width, generator=gen) * s
               for n, s in ((pool, 1), (pool, 3), (step, 1), (step, 3))]  # fmt: skip
    rows = torch.randint(0, pool + step, (entries, window), generator=gen)
    rows[torch.rand(entries, window, generator=gen) < 0.3] = -1
    rows[:, 0] = torch.randint(0, pool + step, (entries,), generator=gen)
    fk, fs, sk, ss = (t.to(DEVICE) for t in sources)
    sk, ss = sk.to(step_dtype), ss.to(step_dtype)
    rows = rows.to(DEVICE)
    got = backend.ops["compress_gather_pool"](fk, fs, sk, ss, rows, overlap=overlap,
                                              out_dtype=out_dtype)  # fmt: skip
    src = rows.clamp(min=0)
    kv, score = torch.cat([fk, sk.float()])[src], torch.cat([fs, ss.float()])[src]
    score.masked_fill_((rows < 0).unsqueeze(-1), float("-inf"))
    if overlap:
        r, d = window // 2, width // 2
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
    assert torch.equal(got, backend.ops["compress_pool"](kv, score, out_dtype=out_dtype))


def test_gather_rejects_bad_rows():
    kv = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rows: expected"):
        backend.ops["compress_gather_pool"](kv, kv, kv, kv, torch.zeros(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="second_score: expected"):
        backend.ops["compress_gather_pool"](kv, kv, kv, kv[:2], torch.zeros(3, 2, dtype=torch.long))
