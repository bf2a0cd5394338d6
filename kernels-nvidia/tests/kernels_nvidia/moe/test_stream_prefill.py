"""The stream kernels ("mx") with prefill-sized tiles (tall row blocks, programs in grouped
order) against the reference: small shapes under the interpreter (several row blocks per
expert, so the grouped order and the padding rows matter), and on the GPU every tile shape that
bench_moe.py sweeps for the middle and prefill regimes at V4-Flash and V4.1-Flash shapes (8,192
and 512 tokens beside the conformance kit's 2,048 / 1,000), within the op's stated tolerance."""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.kernels.testing import Case, cases_for, check_case
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia.moe import experts as moe_experts
from deepinfer.kernels_nvidia.moe.experts import MoeTiles

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")

# the tolerance of the conformance kit's fp4_moe_experts cases (unit-spread outputs)
ATOL, RTOL = 4e-2, 2e-2


def _mx(block_m, block_k, warps, stages, group_m=4, down_block_n=0, wgmma_fence=False):
    return MoeTiles(block_m, 128, warps, stages, mma="mx", block_k=block_k, group_m=group_m,
                    down_block_n=down_block_n, wgmma_fence=wgmma_fence)  # fmt: skip


# Interpreter-sized variants: 16/32-row blocks, grouped order over 2 or 3 blocks, 2-D grid.
SMALL = {
    "mx-32-g2": MoeTiles(32, 64, 4, 1, mma="mx", block_k=64, group_m=2, down_block_n=32),
    "mx-16-g3": MoeTiles(16, 32, 4, 1, mma="mx", block_k=32, group_m=3),
    "mx-32-grid2d": MoeTiles(32, 64, 4, 1, mma="mx", block_k=32, group_m=0),
}
# Every prefill / middle variant bench_moe.py sweeps (the defaults come from STREAM_TILES). Shapes
# whose machine code leaves wgmmas in flight across the K loop are not candidates (128 x 128 with
# K step 64 failed here on the H200 at 8,192 tokens) unless ``wgmma_fence`` removes the pattern.
PREFILL = {
    "mx-128-k128-w8s3": _mx(128, 128, 8, 3),
    "mx-64-k128-w8s3": _mx(64, 128, 8, 3),
    "mx-128-k64-w8s4-fence": _mx(128, 64, 8, 4, wgmma_fence=True),
}
MIDDLE = {
    "mx-64-k128-w8s3": _mx(64, 128, 8, 3),
    "mx-32-k128-w8s4": _mx(32, 128, 8, 4),
}
for _limit, _tiles in moe_experts.STREAM_TILES:  # the defaults are always among the tested
    assert _tiles in {*PREFILL.values(), *MIDDLE.values()}, _tiles
# (tokens, experts, top_k, dim, inter, group)
PREFILL_SHAPES = {"v4-flash-8192t": (8192, 256, 6, 4096, 2048, 128),
                  "v41-flash-8192t": (8192, 384, 6, 5120, 2304, 32)}  # fmt: skip
MIDDLE_SHAPES = {"v4-flash-512t": (512, 256, 6, 4096, 2048, 128),
                 "v41-flash-512t": (512, 384, 6, 5120, 2304, 32)}  # fmt: skip


def _with_tiles(tiles):
    def run(*args, **kwargs):
        return moe_experts.fp4_moe_experts_tiles(*args, **kwargs, tiles=tiles)

    return run


def _inputs(gen, device, *, tokens, experts, top_k, dim, inter, group):
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    x = torch.randn(tokens, dim, generator=g, device=device).bfloat16()
    ids = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g, device=device) + 0.25
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), device)
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), device)
    args = (x, weights, ids.to(torch.int32), w13, s13, w2, s2)
    return args, {"swiglu_limit": 10.0, "act_quant_group": group}


def _case(name, shape):
    tokens, experts, top_k, dim, inter, group = shape
    make = functools.partial(_inputs, tokens=tokens, experts=experts, top_k=top_k, dim=dim,
                             inter=inter, group=group)  # fmt: skip
    return Case("fp4_moe_experts", name, "real", make, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("case", cases_for(["fp4_moe_experts"], "small"), ids=str)
def test_prefill_tiles_small(case, name):
    check_case(_with_tiles(SMALL[name]), case, DEVICE)


@pytest.mark.parametrize("name", list(SMALL))
def test_many_blocks_per_expert_small(name):
    """40 tokens on 3 experts: several row blocks per expert and partly padded last blocks."""
    case = _case("40t-3e", (40, 3, 2, 64, 64, 32))
    check_case(_with_tiles(SMALL[name]), case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(PREFILL))
@pytest.mark.parametrize("shape", list(PREFILL_SHAPES))
def test_prefill_tiles_real(shape, name):
    check_case(_with_tiles(PREFILL[name]), _case(shape, PREFILL_SHAPES[shape]), DEVICE)


def _middle_cases():
    real = [c for c in cases_for(["fp4_moe_experts"], "real") if "64t-" not in c.name]
    return real + [_case(name, shape) for name, shape in MIDDLE_SHAPES.items()]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(MIDDLE))
@pytest.mark.parametrize("case", _middle_cases(), ids=str)
def test_middle_tiles_real(case, name):
    check_case(_with_tiles(MIDDLE[name]), case, DEVICE)


@pytest.mark.parametrize(
    ("tokens", "experts", "block_m"),
    [(64, 256, 16), (512, 256, 32), (2048, 256, 64), (8192, 256, 128), (8192, 384, 128)],
)
def test_choose_tiles_picks_row_blocks_by_rows_per_expert(tokens, experts, block_m):
    tiles = moe_experts.choose_tiles(tokens * 6, experts, batch_invariant=False, on_cpu=False)
    assert tiles.mma == "mx"
    assert tiles.block_m == block_m
    invariant = moe_experts.choose_tiles(tokens * 6, experts, batch_invariant=True, on_cpu=False)
    assert invariant == moe_experts.BATCH_INVARIANT_TILES
