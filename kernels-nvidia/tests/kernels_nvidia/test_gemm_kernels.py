"""FP8 block-scaled GEMM and the FP8 linear path against the reference (conformance kit), plus
batch invariance and contract errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import OPS
from deepinfer.kernels.reference import quant as ref_quant
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.gemm import random_fp8_weight
from deepinfer.kernels_nvidia import gemm
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
OPS_HERE = ["fp8_gemm_nt", "linear"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_gemm_kernels_are_registered():
    assert IMPLEMENTATIONS["fp8_gemm_nt"] is gemm.fp8_gemm_nt
    assert IMPLEMENTATIONS["linear"] is gemm.linear


@pytest.mark.parametrize("case", cases_for(OPS_HERE, "small"), ids=str)
def test_conformance_small(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS_HERE, "real"), ids=str)
def test_conformance_real(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


def test_linear_other_formats_fall_back_to_the_reference():
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    torch.testing.assert_close(gemm.linear(x, w), OPS["linear"].reference(x, w))


def test_linear_keeps_leading_dims():
    gen = torch.Generator().manual_seed(0)
    w, s = random_fp8_weight(gen, 64, 128, (32, 32), torch.device(DEVICE))
    x = torch.randn(2, 3, 128, device=DEVICE).bfloat16()
    got = gemm.linear(x, w, s, block_size=(32, 32), act_quant_group=32)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    flat = gemm.linear(x.view(6, 128), w, s, block_size=(32, 32), act_quant_group=32)
    assert torch.equal(got.view(6, 64), flat)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_matches_the_reference(split_k):
    gen = torch.Generator().manual_seed(split_k)
    w, s = random_fp8_weight(gen, 96, 1024, (128, 128), torch.device(DEVICE))
    a, sa = ref_quant.fp8_act_quant(torch.randn(5, 1024, device=DEVICE), 128)
    tiles = gemm.GemmTiles(32 if not HAS_CUDA else 64, 64, 1, 4, 2, split_k)
    got = gemm.fp8_gemm_nt_tiles(a, sa, w, s, (128, 128), out_dtype=torch.float32, tiles=tiles)
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, s, (128, 128), out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("tiles", [gemm.UNIFORM_TILES, gemm.GemmTiles(64, 64, 1, 4, 6, 2)], ids=str)
def test_device_tile_shapes_match_the_reference(tiles, block):
    """The GPU tile shapes (run here under the interpreter on CPU), with ragged M and N edges."""
    gen = torch.Generator().manual_seed(3)
    w, s = random_fp8_weight(gen, 200, 512, block, torch.device(DEVICE))
    a, sa = ref_quant.fp8_act_quant(torch.randn(70, 512, device=DEVICE), block[1])
    got = gemm.fp8_gemm_nt_tiles(a, sa, w, s, block, out_dtype=torch.float32, tiles=tiles)
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, s, block, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_tile_policy_splits_only_small_m_fine_scales_few_tiles():
    def choose(m, n, k, sub_k, invariant=False):
        return gemm.choose_tiles(m, n, k, sub_k, batch_invariant=invariant, on_cpu=False)

    assert choose(4096, 4096, 8192, 128) == gemm.UNIFORM_TILES
    assert choose(1, 4096, 8192, 128) == gemm.UNIFORM_TILES
    assert choose(1, 32768, 1280, 32) == gemm.UNIFORM_TILES
    assert choose(1, 1280, 5120, 32).split_k == 2
    assert choose(64, 2304, 5120, 32).split_k == 2
    assert choose(1, 1280, 5120, 32, invariant=True) == gemm.UNIFORM_TILES
    assert all(choose(m, 1280, 5120, 32) == gemm.UNIFORM_TILES for m in (65, 1000))


def test_rejects_scale_of_the_wrong_shape():
    a = torch.randn(4, 128, device=DEVICE).to(torch.float8_e4m3fn)
    sa = torch.ones(4, 1, device=DEVICE)
    sb = torch.full((2, 2), 127, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="b_scale"):
        gemm.fp8_gemm_nt(a, sa, a, sb, (128, 128))


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_batch_invariance(block, monkeypatch):
    """With DEEPINFER_BATCH_INVARIANT=1 a row's output is bitwise identical for every batch."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    n, k = (4096, 4096) if HAS_CUDA else (64, 256)
    sizes = (1, 7, 64, 1000) if HAS_CUDA else (1, 7, 40)
    gen = torch.Generator().manual_seed(1)
    w, s = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    x = torch.randn(max(sizes), k, device=DEVICE)
    a, sa = ref_quant.fp8_act_quant(x, block[1])
    rows = [gemm.fp8_gemm_nt(a[:m], sa[:m], w, s, block)[0] for m in sizes]
    for row in rows[1:]:
        assert torch.equal(row, rows[0])
    lin = [
        gemm.linear(x[:m].bfloat16(), w, s, block_size=block, act_quant_group=block[1])[0]
        for m in sizes
    ]
    for row in lin[1:]:
        assert torch.equal(row, lin[0])
