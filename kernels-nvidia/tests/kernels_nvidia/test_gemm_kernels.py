"""FP8 block-scaled GEMM and the FP8 linear path against the reference (conformance kit), plus
batch invariance and contract errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import OPS
from deepinfer.kernels.reference import quant as ref_quant
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.gemm import random_fp8_weight
from deepinfer.kernels_nvidia.gemm import bf16 as gemm_bf16
from deepinfer.kernels_nvidia.gemm import cublas as gemm_cublas
from deepinfer.kernels_nvidia.gemm import dense as gemm_dense
from deepinfer.kernels_nvidia.gemm import ops as gemm
from deepinfer.kernels_nvidia.gemm import stream as gemm_stream
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
OPS_HERE = ["fp8_gemm_nt", "linear", "linears"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_gemm_kernels_are_registered():
    assert IMPLEMENTATIONS["fp8_gemm_nt"] is gemm.fp8_gemm_nt
    assert IMPLEMENTATIONS["linear"] is gemm.linear
    assert IMPLEMENTATIONS["linears"] is gemm.linears


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


@pytest.mark.parametrize("m, block", [(1, (128, 128)), (5, (32, 32)), (40, (128, 128))])
def test_linears_equal_separate_linears(m, block):
    """One shared activation quantisation: each output bit for bit its own ``linear`` call,
    a dense weight among them included (it takes its own route)."""
    gen = torch.Generator().manual_seed(m)
    device = torch.device(DEVICE)
    (w1, s1), (w2, s2) = (random_fp8_weight(gen, n, 256, block, device) for n in (160, 64))
    dense = torch.randn(32, 256, generator=gen).to(DEVICE, torch.bfloat16)
    x = torch.randn(m, 256, generator=gen).to(DEVICE, torch.bfloat16)
    kw = {"block_size": block, "act_quant_group": block[1]}
    weights, scales = (w1, w2, dense), (s1, s2, None)
    got = gemm.linears(x, weights, scales, **kw)
    for y, w, s in zip(got, weights, scales, strict=True):
        assert torch.equal(y, gemm.linear(x, w, s, **kw))
    with pytest.raises(ValueError, match="one scale each"):
        gemm.linears(x, weights, scales[:2], **kw)


def _product(m, n, k, block, seed):
    gen = torch.Generator().manual_seed(seed)
    w, s = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    a, sa = ref_quant.fp8_act_quant(x, block[1])
    want = OPS["fp8_gemm_nt"].reference(a, sa, w, s, block, out_dtype=torch.float32)
    return (a, sa, w, s, block), want


TILE_VARIANTS = [
    gemm.UNIFORM_TILES,
    gemm.GemmTiles(64, 64, 1, 4, 2, block_k=256),
    gemm.GemmTiles(32, 64, 4, 4, 2, programs_per_sm=1, a_scale_k_major=True),
    gemm.GemmTiles(32, 128, 4, 4, 2, use_tma=True),
    gemm.GemmTiles(32, 64, 4, 4, 2, use_tma=True, programs_per_sm=2, flatten=True),
]


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("tiles", TILE_VARIANTS, ids=str)
def test_tile_variants_match_the_reference(tiles, block):
    """Every tile-kernel variant (pointer / TMA, one program per tile / persistent, scalar and
    per-column weight scales), with ragged M and N edges; on CPU under the interpreter."""
    args, want = _product(70, 200, 512, block, seed=3)
    got = gemm.fp8_gemm_nt_tiles(*args, out_dtype=torch.float32, tiles=tiles)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [96, 200])
def test_stream_kernel_matches_the_reference(m, n, block):
    """The decode kernel at a split-K of 4 (K=512: 4 stages of 128) and ragged N; its fp32
    partials are summed by the last split of each N slice."""
    args, want = _product(m, n, 512, block, seed=m + n)
    tiles = gemm.StreamTiles(block_n=64, target_programs=4 * -(-n // 64))
    assert gemm_stream.choose_split(n, 512, 128, tiles) == 4
    got = gemm.fp8_gemm_nt_tiles(*args, out_dtype=torch.float32, tiles=tiles)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    again = gemm.fp8_gemm_nt_tiles(*args, out_dtype=torch.float32, tiles=tiles)
    assert torch.equal(got, again)  # tickets were reset; the fixed summation order repeats


def test_stream_rows_do_not_depend_on_m():
    """The split comes from (N, K) only: a row's output is the same at every M <= 64."""
    args, _ = _product(64, 96, 512, (128, 128), seed=9)
    a, sa, *rest = args
    tiles = gemm.StreamTiles(block_n=64, target_programs=8)
    rows = [gemm.fp8_gemm_nt_tiles(a[:m], sa[:m], *rest, out_dtype=torch.float32, tiles=tiles)[0]
            for m in (1, 7, 64)]  # fmt: skip
    assert all(torch.equal(r, rows[0]) for r in rows[1:])


def test_bf16_route_matches_the_reference():
    args, want = _product(40, 96, 256, (32, 32), seed=5)
    got = gemm.fp8_gemm_nt_tiles(*args, out_dtype=torch.bfloat16, tiles=None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


def test_dequantize_to_bf16_is_exact():
    gen = torch.Generator().manual_seed(4)
    w, s = random_fp8_weight(gen, 70, 256, (32, 32), torch.device(DEVICE))
    got = gemm_bf16.dequantize_to_bf16(w, s.view(torch.uint8), (32, 32))
    want = ref_quant.fp8_block_dequant(w, s, (32, 32), out_dtype=torch.float32)
    assert torch.equal(got.float(), want)


def test_plan_policy():
    def plan(m, n=4096, k=8192, sub_k=128, invariant=False, out=torch.bfloat16):
        return gemm.choose_plan(m, n, k, sub_k, out, batch_invariant=invariant, on_cpu=False)

    assert all(plan(m).kind == "stream" for m in (1, 8, 32))
    assert all(plan(m, sub_k=32).kind == "stream" for m in (1, 33, 64))
    assert plan(33).kind == plan(65, sub_k=32).kind == plan(4096).kind == "tiles"
    assert plan(64).tiles == gemm.UNIFORM_TILES
    assert plan(4096, k=4096).tiles == gemm.PREFILL_TILES
    assert plan(4096, k=8192).tiles == gemm.PREFILL_TMA_TILES
    assert plan(1000).tiles == gemm.UNIFORM_TILES
    assert plan(4096, sub_k=32).kind == "bf16"
    assert plan(4096, sub_k=32, out=torch.float32).kind == "tiles"
    assert all(plan(m, sub_k=sk, invariant=True) == gemm.GemmPlan("tiles", gemm.UNIFORM_TILES)
               for m in (1, 64, 4096) for sk in (32, 128))  # fmt: skip


def test_plan_policy_cublas():
    def plan(m, invariant=False, out=torch.bfloat16):
        return gemm.choose_plan(
            m, 4096, 2048, 128, out, batch_invariant=invariant, on_cpu=False, cublas=True
        )

    assert plan(gemm_cublas.MIN_M).kind == plan(8192).kind == "cublas"
    assert plan(gemm_cublas.MIN_M - 1).kind == "tiles" and plan(16).kind == "stream"
    assert plan(4096, out=torch.float32).kind == "tiles"
    assert plan(4096, invariant=True) == gemm.GemmPlan("tiles", gemm.UNIFORM_TILES)
    assert gemm.choose_plan(4096, 4096, 2048, 128, torch.bfloat16, batch_invariant=False,
                            on_cpu=True, cublas=True).kind == "tiles"  # fmt: skip
    assert gemm_cublas.recipe_fits(4096, 2048, 128, (128, 128))
    assert not gemm_cublas.recipe_fits(4096, 2048, 32, (32, 32))
    assert not gemm_cublas.recipe_fits(4000, 2048, 128, (128, 128))
    assert gemm_cublas.recipe_fits(512, 4096, 128, (128, 128))
    assert not gemm_cublas.recipe_fits(384, 4096, 128, (128, 128))  # N < MIN_N: the tiles


needs_hopper = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m", [1024, 1037, 4096])
@pytest.mark.parametrize("n, k", [(4096, 2048), (1024, 4096), (32768, 1024), (512, 4096)])
def test_cublas_route_matches_the_reference(m, n, k):
    """Prefill-sized V4 products take cuBLAS's blockwise FP8 GEMM (or, where it refuses a
    shape, the tiles) and match the reference to bf16 rounding."""
    assert gemm_cublas.available(torch.cuda.current_device())
    args, want = _product(m, n, k, (128, 128), seed=m + n)
    got = gemm.fp8_gemm_nt(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)
    a, sa, w, s, _ = args
    direct = gemm_cublas.fp8_gemm_cublas(a, sa, w, s.view(torch.uint8))
    if m % 16 == 0:
        assert direct is not None, "cuBLAS refused an aligned V4 shape"
    if direct is not None:
        assert torch.equal(got, direct)  # the default plan ran cuBLAS


@pytest.mark.gpu
@needs_hopper
def test_cublas_refusal_falls_back_to_the_tiles():
    args, want = _product(1024, 1024, 4096, (128, 128), seed=3)
    key = (torch.cuda.current_device(), 1024, 4096, 0)
    had = key in gemm_cublas._REFUSED
    gemm_cublas._REFUSED.add(key)
    try:
        got = gemm.fp8_gemm_nt(*args)
    finally:
        if not had:
            gemm_cublas._REFUSED.discard(key)
    tiles = gemm.fp8_gemm_nt_tiles(*args, out_dtype=torch.bfloat16, tiles=gemm.PREFILL_TILES)
    assert torch.equal(got, tiles)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


def test_weight_scales_are_converted_once_per_scale_tensor():
    gen = torch.Generator().manual_seed(11)
    exps = torch.randint(118, 134, (8, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)  # as the weights store them
    first = gemm_cublas.weight_scales(scale)
    assert torch.equal(first, torch.exp2(exps.float() - 127.0).t())
    assert first.shape == (4, 8) and first.stride() == (1, 4)  # [K/128, N/128], unit stride on K
    assert gemm_cublas.weight_scales(scale) is first  # kept
    exps.add_(1)  # an in-place write (through another view): converted again
    again = gemm_cublas.weight_scales(scale)
    assert again is not first and torch.equal(again, first * 2)
    twin = exps.clone()  # equal values, another tensor: its own conversion
    assert gemm_cublas.weight_scales(twin) is not again
    count = len(gemm_cublas._WEIGHT_SCALES)
    del twin  # dropped with its tensor
    assert len(gemm_cublas._WEIGHT_SCALES) == count - 1


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("m, n, k", [(1024, 1024, 4096), (2048, 4096, 2048)])
def test_linear_writes_m_major_scales_for_cublas(m, n, k):
    """``linear`` at prefill M quantises with M-major scales and takes cuBLAS: the same result
    as the product of the row-major scales (copied for cuBLAS), and the reference's."""
    gen = torch.Generator().manual_seed(m + k)
    w, s = random_fp8_weight(gen, n, k, (128, 128), torch.device("cuda"))
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    plan = gemm.default_plan(m, n, k, 128, 128, (128, 128), torch.bfloat16, x.device)
    assert plan.kind == "cublas"
    got = gemm.linear(x, w, s, block_size=(128, 128), act_quant_group=128)
    a, sa = gemm.quantize_rows(x, 128)
    assert sa.is_contiguous()
    assert torch.equal(got, gemm.fp8_gemm_nt(a, sa, w, s, (128, 128)))
    want = OPS["linear"].reference(x, w, s, block_size=(128, 128), act_quant_group=128)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


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


@pytest.mark.parametrize("m, n, k", [(1, 200, 96), (5, 130, 64), (40, 64, 160)])
def test_f32_bf16_linear_matches_the_reference(m, n, k):
    """fp32 x bf16 -> fp32 (the LM head's product): the three-way bf16 split of the activations
    gives the reference's products up to fp32 summation order."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE)
    w = torch.randn(n, k, generator=gen).bfloat16().to(DEVICE)
    got = gemm.linear(x, w, out_dtype=torch.float32)
    want = OPS["linear"].reference(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)
    # a bf16-only product (what a plain bf16 GEMM would give) is far outside that tolerance
    coarse = x.bfloat16().float() @ w.float().t()
    assert (coarse - want).abs().max() > 100 * (got - want).abs().max()


def test_f32_bf16_linear_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=gen).to(DEVICE)
    w = torch.randn(72, 96, generator=gen).bfloat16().to(DEVICE)
    full = gemm_dense.linear_f32_bf16(x, w)
    for m in (1, 7, 17):
        assert torch.equal(gemm_dense.linear_f32_bf16(x[:m].contiguous(), w), full[:m])


def test_f32_bf16_linear_splits_k_for_a_weight_of_few_rows():
    """The router's shape class (few weight rows, long K) runs in K chunks summed in chunk
    order: the reference's products, rows independent of the batch; the LM head's does not."""
    assert gemm_dense.k_splits(256, 4096) == (32, 128)  # V4-Flash router: 64 programs
    assert gemm_dense.k_splits(129280, 4096) == (1, 4096)  # the LM head
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(19, 1000, generator=gen) * 3).to(DEVICE)
    w = torch.randn(40, 1000, generator=gen).bfloat16().to(DEVICE)
    assert gemm_dense.k_splits(40, 1000)[0] > 1
    got = gemm_dense.linear_f32_bf16(x, w)
    want = OPS["linear"].reference(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * 1000**0.5)
    for m in (1, 7):
        assert torch.equal(gemm_dense.linear_f32_bf16(x[:m].contiguous(), w), got[:m])


@pytest.mark.gpu
@gpu
def test_f32_bf16_linear_at_the_head_shape():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 4096, generator=gen).to(DEVICE)
    w = (torch.randn(129280, 4096, generator=gen) * 0.02).bfloat16().to(DEVICE)
    got = gemm.linear(x, w, out_dtype=torch.float32)
    want = x @ w.float().t()
    err = (got - want).abs().max().item()
    rms = want.pow(2).mean().sqrt().item()
    # tensor-core partial sums (see gemm_dense): within 2^-14 of the output RMS, and at least
    # 100x closer than a product of the activations rounded to bf16
    assert err <= rms * 2**-14, (err, rms)
    coarse = (x.bfloat16().float() @ w.float().t() - want).abs().max().item()
    assert err * 100 < coarse, (err, coarse)
    assert torch.equal(gemm.linear(x[:1], w, out_dtype=torch.float32), got[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_invariant_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 200, generator=gen).to(DEVICE, dtype)
    w = torch.randn(70, 200, generator=gen).to(DEVICE, dtype)
    together = gemm_dense.matmul_invariant(x, w)
    for i in (0, 17, 36):
        assert torch.equal(gemm_dense.matmul_invariant(x[i : i + 1], w), together[i : i + 1])
    assert torch.equal(gemm_dense.matmul_invariant(x[5:9], w), together[5:9])
    want = (x.double() @ w.double().t()).to(dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(together, want, rtol=tol, atol=tol)


def test_matmul_invariant_names_bad_operands():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="expected one of"):
        gemm_dense.matmul_invariant(x, torch.randn(4, 8, device=DEVICE).bfloat16())
    with pytest.raises(ValueError, match=r"expected \[M, K\]"):
        gemm_dense.matmul_invariant(x, torch.randn(4, 9, device=DEVICE))


@pytest.mark.gpu
@gpu
def test_dense_linear_is_batch_invariant_under_the_flag(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50, 256, generator=gen).to(DEVICE)
    w = torch.randn(96, 256, generator=gen).to(DEVICE)
    together = gemm.linear(x, w)
    alone = torch.cat([gemm.linear(x[i : i + 1], w) for i in range(50)])
    assert torch.equal(alone, together)
    torch.testing.assert_close(together, OPS["linear"].reference(x, w), rtol=1e-4, atol=1e-4)
