"""The chunked top-k/top-p/min-p cutoff: every path (sorted candidates, searched candidates,
whole-row search) equals the reference exactly, at the top-p boundary too; the conformance check
catches a wrong cutoff; batch invariance; real shapes and every tuning variant on the GPU."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before kernels are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer.kernels.testing import cases_for, check_case, patch_triton_interpreter  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer.kernels.reference import sampling as ref  # noqa: E402
from deepinfer.kernels_nvidia import sampling_cutoff  # noqa: E402
from deepinfer.kernels_nvidia.sampling_cutoff_search import exp_nonpositive  # noqa: E402

CUTOFF = "top_k_top_p_min_p_cutoff"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="interpreter run")
needs_gpu = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs an NVIDIA GPU (and no interpreter)"
)
# search the candidates; sort few, search more, whole row past 16 (fused finish)
SMALL_VARIANTS = {
    "search": dict(cap=8192, sort_cap=0),
    "sort": dict(cap=64, sort_cap=32),
    "mixed-fused": dict(cap=16, sort_cap=4, fused_finish=True),
}


@interpreted_only
@pytest.mark.parametrize("variant", sorted(SMALL_VARIANTS))
@pytest.mark.parametrize("case", cases_for([CUTOFF], "small"), ids=str)
def test_cutoff_conformance_small_interpreted(case, variant):
    impl = functools.partial(sampling_cutoff.cutoff, **SMALL_VARIANTS[variant])
    for seed in range(2):
        check_case(impl, case, device="cpu", seed=seed)


@triton.jit
def _exp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n)
    tl.store(out_ptr + cols, exp_nonpositive(x), mask=cols < n)


def test_exp_is_bit_identical_to_the_reference():
    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(5)
    x = (
        -torch.rand(8192, generator=gen)
        * torch.tensor([1.0, 10.0, 100.0]).repeat(8192 // 3 + 1)[:8192]
    )
    edges = torch.tensor([0.0, -0.0, -1e-30, -87.0, -86.99, -87.01, float("-inf"), -0.34657359])
    x = torch.cat([x, edges]).to(device)
    out = torch.empty_like(x)
    _exp_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, out, x.numel(), BLOCK=1024, enable_fp_fusion=False
    )
    want = ref.exp_nonpositive(x)
    assert torch.equal(out, want)
    exact = torch.exp(x.double())
    inside = x >= -87.0  # below: defined as 0
    assert ((want.double() - exact).abs() <= 3e-7 * exact)[inside].all()
    assert (want[~inside] == 0).all()


def _boundary_row(gen, vocab):
    """One row, its fixed-point masses and the (sorted) value index whose top-p cut we probe."""
    logits = torch.randn(1, vocab, generator=gen) * 2.0
    s, _ = torch.sort(logits[0], descending=True)
    mass = ref.fixed_mass(ref.exp_nonpositive(s - s[0]))
    return logits, mass.cumsum(0), mass.sum()


@interpreted_only
def test_top_p_exactly_at_the_boundary_matches_the_reference():
    """p Z equal (to float64 rounding) to the mass above a value: the kept set flips across the
    neighbouring float32 p, and the kernel follows the reference at each of them."""
    gen = torch.Generator().manual_seed(9)
    logits, inclusive, z = _boundary_row(gen, 300)
    ones = torch.ones(1)
    seen = set()
    for i in (3, 10, 40):
        p0 = torch.tensor([inclusive[i - 1].item() / z.item()], dtype=torch.float32)
        for p in (p0, torch.nextafter(p0, ones), torch.nextafter(p0, -ones)):
            args = (logits, ones, torch.zeros(1, dtype=torch.int32), p, torch.zeros(1))
            want = ref.top_k_top_p_min_p_cutoff(*args)
            for variant in SMALL_VARIANTS.values():
                got = sampling_cutoff.cutoff(*args, **variant)
                assert torch.equal(got, want), (i, p.item(), variant)
            seen.add((i, want.item()))
    assert len(seen) > 3, "the probes never crossed a top-p boundary"


@interpreted_only
@pytest.mark.parametrize("case_name, seed, row", [("64x129280-random", 7, 44)])
def test_searching_candidates_for_top_p_alone_starts_below_every_kept_value(case_name, seed, row):
    """Regression (seen on the H200): with top-k off the candidates' mass may exceed
    p Z by a hair, so the whole-row mass bound must not start the candidate search (it cut a
    kept value). One real-size row, searched rather than sorted."""
    case = next(c for c in cases_for([CUTOFF], "real") if c.name == case_name)
    args, _ = case.make_inputs(torch.Generator().manual_seed(seed), torch.device("cpu"))
    one = tuple(a[row : row + 1] for a in args)
    assert one[2].item() >= 129280 and one[3].item() < 1.0  # top-p alone
    got = sampling_cutoff.cutoff(*one, cap=8192, sort_cap=0)
    assert torch.equal(got, ref.top_k_top_p_min_p_cutoff(*one))


def _reference_with(transform):
    def impl(logits, temperature, top_k, top_p, min_p):
        return ref.top_k_top_p_min_p_cutoff(logits, temperature, top_k, *transform(top_p, min_p))

    return impl


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(lambda p, mp: (torch.where(p < 1, p * 0.7, p), mp), id="top_p-x0.7"),
        pytest.param(lambda p, mp: (p, torch.where(mp > 0, mp * 3, mp)), id="min_p-x3"),
    ],
)
def test_conformance_check_catches_a_cutoff_away_from_the_boundary(wrong):
    case = next(c for c in cases_for([CUTOFF], "small") if c.name == "6x300-random")
    check_case(ref.top_k_top_p_min_p_cutoff, case, device="cpu", seed=0)  # the check passes
    with pytest.raises(AssertionError):
        for seed in range(4):  # some row of some seed has the filter on
            check_case(_reference_with(wrong), case, device="cpu", seed=seed)


@interpreted_only
def test_a_row_gets_the_same_cutoff_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(2)
    vocab = 700
    logits = torch.randn(4, vocab, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.9])
    top_k = torch.tensor([0, 20, 0, 5], dtype=torch.int32)
    top_p = torch.tensor([0.8, 0.9, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0])
    batch = sampling_cutoff.cutoff(logits, temperature, top_k, top_p, min_p, sort_cap=16)
    for r in range(4):
        alone = sampling_cutoff.cutoff(
            logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1],
            min_p[r : r + 1], sort_cap=16,
        )  # fmt: skip
        assert torch.equal(alone, batch[r : r + 1])


# every tuning variant the benchmark sweeps: the default is picked from its table
GPU_VARIANTS = [
    dict(cap=8192, sort_cap=1024, max_chunks=32),
    dict(cap=8192, sort_cap=1024, max_chunks=32, fused_finish=True),
    dict(cap=8192, sort_cap=0, max_chunks=32),
    dict(cap=8192, sort_cap=256, max_chunks=16, fused_finish=True),
    dict(cap=8192, sort_cap=2048, max_chunks=64),
    dict(cap=256, sort_cap=128, max_chunks=32),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS, ids=str)
@pytest.mark.parametrize("case", cases_for([CUTOFF], "real"), ids=str)
def test_cutoff_variants_real_gpu(case, variant):
    check_case(functools.partial(sampling_cutoff.cutoff, **variant), case, device="cuda", seed=7)


@pytest.mark.gpu
@needs_gpu
def test_cutoff_on_benchmark_shaped_rows_with_every_filter_mix():
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 256, 129280
    logits = (torch.randn(rows, vocab, generator=gen) * 4.0).cuda()
    logits[::7] = logits[::7] * 0.05  # nearly flat rows: top-p alone keeps many thousands
    temperature = (0.5 + torch.rand(rows, generator=gen)).cuda()
    top_k = torch.tensor([50, 0, 1000, 0, 5, 20000, -1, 50], dtype=torch.int64).repeat(32).cuda()
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.99, 0.9, 0.8, 1.0]).repeat(32).cuda()
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.05, 0.2]).repeat(32).cuda()
    args = (logits, temperature, top_k, top_p, min_p)
    want = ref.top_k_top_p_min_p_cutoff(*args)
    for variant in GPU_VARIANTS:
        assert torch.equal(sampling_cutoff.cutoff(*args, **variant), want), variant
