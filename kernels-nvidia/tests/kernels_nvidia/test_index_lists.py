"""``join_index_lists`` against the reference (bit for bit: integers), and its errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels_nvidia import backend

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("case", cases_for(["join_index_lists"], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(["join_index_lists"], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


def test_holes_stay_holes_and_offsets_move_the_rest():
    first = torch.tensor([[3, -1], [0, 7]], dtype=torch.int32, device=DEVICE)
    second = torch.tensor([[-1, 2, 0], [5, -1, -1]], device=DEVICE)
    got = backend.ops["join_index_lists"](first, second, 10)
    want = [[3, -1, -1, 12, 10], [0, 7, 15, -1, -1]]
    assert got.dtype == torch.int32 and got.tolist() == want


def test_rejects_mismatched_rows_and_float_lists():
    first = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="second: expected 3 rows"):
        backend.ops["join_index_lists"](first, first[:2], 1)
    with pytest.raises(ValueError, match="first: expected int32/int64"):
        backend.ops["join_index_lists"](first.float(), first, 1)
