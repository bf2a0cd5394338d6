"""top_k_top_p_min_p_sample: the draw from the cutoff's candidates equals the reference (cutoff
then whole-row Gumbel) exactly, on rows drawn from candidates and on rows flagged for the
whole-row draw, for every tuning variant."""

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

from deepinfer.kernels.reference import sampling as ref  # noqa: E402
from deepinfer.kernels_nvidia import sampling_draw  # noqa: E402

OP = "top_k_top_p_min_p_sample"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="interpreter run")
needs_gpu = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs an NVIDIA GPU (and no interpreter)"
)
# defaults; candidates searched, not sorted; few candidates: many rows take the whole-row path
VARIANTS = {
    "default": dict(),
    "search": dict(cap=8192, sort_cap=0),
    "tiny-cap": dict(cap=16, sort_cap=4),
}


@interpreted_only
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", cases_for([OP], "small"), ids=str)
def test_sample_conformance_small_interpreted(case, variant):
    impl = functools.partial(sampling_draw.cutoff_and_draw, **VARIANTS[variant])
    for seed in range(2):
        check_case(impl, case, device="cpu", seed=seed)


def _rows_with_every_path(gen, rows, vocab):
    """Rows that take each way: top-k (candidates), top-p alone (candidates or the row search),
    min-p alone and no filter (whole-row draw), ties at the cut, a fully masked row."""
    logits = torch.round(torch.randn(rows, vocab, generator=gen) * 6.0) / 2.0  # many ties
    logits[1::4] *= 0.05  # flat rows: top-p alone keeps most of them
    logits[-1] = float("-inf")  # nothing finite: token 0, as the reference's argmax
    temperature = 0.5 + torch.rand(rows, generator=gen)
    top_k = torch.tensor([5, 0, -1, 40, 0, vocab], dtype=torch.int64).repeat(rows)[:rows]
    top_p = torch.tensor([0.9, 0.8, 1.0, 1.0, 0.3, 0.95]).repeat(rows)[:rows]
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0]).repeat(rows)[:rows]
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 1 << 30, (rows,), generator=gen, dtype=torch.int64)
    return logits, temperature, top_k, top_p, min_p, seeds, positions


@interpreted_only
def test_every_path_draws_the_reference_token():
    gen = torch.Generator().manual_seed(12)
    args = _rows_with_every_path(gen, 13, 900)
    want_tokens, want_cut = ref.top_k_top_p_min_p_sample(*args, 1)
    for variant in VARIANTS.values():
        tokens, cut = sampling_draw.cutoff_and_draw(*args, 1, **variant)
        assert torch.equal(cut, want_cut), variant
        assert torch.equal(tokens, want_tokens), variant
    assert want_tokens[-1].item() == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", cases_for([OP], "real"), ids=str)
def test_sample_conformance_real_gpu(case, variant):
    impl = functools.partial(sampling_draw.cutoff_and_draw, **VARIANTS[variant])
    check_case(impl, case, device="cuda", seed=5)


@pytest.mark.gpu
@needs_gpu
def test_benchmark_shaped_rows_draw_what_the_two_ops_draw():
    gen = torch.Generator().manual_seed(4)
    args = [a.cuda() for a in _rows_with_every_path(gen, 256, 129280)]
    from deepinfer.kernels_nvidia import sampling, sampling_cutoff

    cut = sampling_cutoff.cutoff(*args[:5])
    want = sampling.gumbel(*args[:2], cut, *args[5:], 0)
    for variant in VARIANTS.values():
        tokens, got_cut = sampling_draw.cutoff_and_draw(*args, 0, **variant)
        assert torch.equal(got_cut, cut) and torch.equal(tokens, want), variant
