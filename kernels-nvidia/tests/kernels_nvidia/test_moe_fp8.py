"""The FP8 / fp16 tensor-core family of the FP4 routed experts (``moe_fp8``, opt-in): the nibble
expansion against the e2m1 table (inline PTX on the GPU, plain Triton under the interpreter),
tile variants against the reference, and weights whose 32-column scales differ a lot."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels import OPS
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia import moe_experts, moe_fp8
from deepinfer.kernels_nvidia.moe_experts import MoeTiles

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 nibble codes (int, 0..15)."""
    magnitude = E2M1.to(codes.device)[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _f16_kernel(p_ptr, lo_ptr, hi_ptr, USE_ASM: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    lo, hi = moe_fp8.nibbles_to_f16(tl.load(p_ptr + offs), USE_ASM)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def test_nibbles_to_f16_is_exact_for_every_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).to(DEVICE)
    lo = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    hi = torch.empty_like(lo)
    _f16_kernel[(1,)](packed, lo, hi, USE_ASM=HAS_CUDA, R=16, C=16)
    codes = packed.to(torch.int64)
    assert torch.equal(lo.float(), e2m1_values(codes & 15) * 2.0**-14)
    assert torch.equal(hi.float(), e2m1_values(codes >> 4) * 2.0**-14)


FAMILY_SMALL = {
    "fp8-swap": MoeTiles(16, 64, 4, 1, mma="fp8", swap_ab=True, down_block_n=32),
    "fp8": MoeTiles(16, 64, 4, 1, mma="fp8", down_block_n=32),
    "fp16-swap": MoeTiles(16, 64, 4, 1, mma="fp16", swap_ab=True, down_block_n=32),
    "fp16": MoeTiles(16, 64, 4, 1, mma="fp16", down_block_n=32),
}
# Hopper's FP8 MMA accumulates with a short mantissa: at the decode tiles the error measured on
# the H200 exceeded the conformance tolerance at 2,048 / 1,000 tokens (not at 64).
FP8_ACCUMULATION = pytest.mark.xfail(
    HAS_CUDA, reason="FP8 tensor-core accumulation error above the op tolerance", strict=False
)
FAMILY_REAL = {
    "fp16-decode": MoeTiles(16, 128, 8, 4, mma="fp16", swap_ab=True),
    "fp16-decode-n256": MoeTiles(16, 256, 8, 4, mma="fp16", swap_ab=True),
    "fp8-decode": pytest.param(MoeTiles(16, 128, 8, 4, mma="fp8", swap_ab=True),
                               marks=FP8_ACCUMULATION),
    "fp8-prefill-n64": MoeTiles(128, 64, 8, 2, mma="fp8", down_block_n=128),
    "fp16-prefill-n64": MoeTiles(128, 64, 8, 2, mma="fp16", down_block_n=128),
}  # fmt: skip


def _with_tiles(tiles):
    def run(*args, **kwargs):
        return moe_experts.fp4_moe_experts_tiles(*args, **kwargs, tiles=tiles)

    return run


@pytest.mark.parametrize("name", list(FAMILY_SMALL))
@pytest.mark.parametrize("case", cases_for(["fp4_moe_experts"], "small")[:4], ids=str)
def test_family_small(case, name):
    check_case(_with_tiles(FAMILY_SMALL[name]), case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiles", list(FAMILY_REAL.values()), ids=list(FAMILY_REAL))
@pytest.mark.parametrize(
    "case", [cases_for(["fp4_moe_experts"], "real")[i] for i in (0, 3, 6)], ids=str
)
def test_family_real(case, tiles):
    check_case(_with_tiles(tiles), case, DEVICE)


def _spread_scale_inputs(tokens, experts, dim, inter, seed):
    """Expert weights whose 32-column scales within a 128-column block differ by up to 12
    octaves, so every expansion shift of the tables is used."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g, device=DEVICE).bfloat16()
    ids = torch.rand(tokens, experts, generator=g, device=DEVICE).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=g, device=DEVICE) + 0.25
    tensors = []
    for shape in ((experts, 2 * inter, dim), (experts, dim, inter)):
        packed, scale = random_fp4_weight(g, shape, DEVICE)
        spread = torch.randint(0, 13, scale.shape, generator=g, device=DEVICE)
        tensors += [packed, (scale.view(torch.uint8).int() - spread).to(torch.uint8)]
    return (x, weights, ids, *tensors)


@pytest.mark.parametrize(
    "name", [pytest.param("fp8-swap", marks=FP8_ACCUMULATION), "fp16-swap", "fp16"]
)
def test_scales_far_apart_within_a_block(name):
    tokens, experts, dim, inter = (64, 8, 512, 256) if HAS_CUDA else (6, 3, 128, 128)
    args = _spread_scale_inputs(tokens, experts, dim, inter, seed=11)
    kw = dict(swiglu_limit=10.0, act_quant_group=128)
    want = OPS["fp4_moe_experts"].reference(*args, **kw)
    tiles = FAMILY_SMALL[name]
    if HAS_CUDA:
        tiles = MoeTiles(16, 128, 4, 3, mma=tiles.mma, swap_ab=tiles.swap_ab)
    got = moe_experts.fp4_moe_experts_tiles(*args, **kw, tiles=tiles)
    spread = want.std()
    assert (got - want).abs().max() <= 0.05 * spread
    assert (got - want).abs().mean() <= 0.005 * spread
