"""The FP8 / fp16 tensor-core family of the FP4 routed experts (``moe_fp8``): the nibble
expansions against the e2m1 table (inline PTX on the GPU, plain Triton under the interpreter),
every tile variant against the reference, and weights whose 32-column scales differ a lot."""

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


@triton.jit
def _e4m3_kernel(p_ptr, d_ptr, w_ptr, USE_ASM: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """``[R, C]`` packed bytes, one ``d`` per row and 16 bytes -> e4m3 ``[R, 2C]``."""
    NG: tl.constexpr = C // 16
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    d = tl.load(d_ptr + tl.arange(0, R)[:, None] * NG + tl.arange(0, NG)[None, :])
    table_lo, table_hi = moe_fp8.e4m3_tables(d)
    table_lo = tl.reshape(tl.broadcast_to(table_lo[:, :, None], (R, NG, 16)), (R, C))
    table_hi = tl.reshape(tl.broadcast_to(table_hi[:, :, None], (R, NG, 16)), (R, C))
    w = moe_fp8.nibbles_to_e4m3(tl.load(p_ptr + offs), table_lo, table_hi, USE_ASM, R)
    out = tl.arange(0, R)[:, None] * (2 * C) + tl.arange(0, 2 * C)[None, :]
    tl.store(w_ptr + out, w)


def test_nibbles_to_f16_is_exact_for_every_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).to(DEVICE)
    lo = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    hi = torch.empty_like(lo)
    _f16_kernel[(1,)](packed, lo, hi, USE_ASM=HAS_CUDA, R=16, C=16)
    codes = packed.to(torch.int64)
    assert torch.equal(lo.float(), e2m1_values(codes & 15) * 2.0**-14)
    assert torch.equal(hi.float(), e2m1_values(codes >> 4) * 2.0**-14)


def test_nibbles_to_e4m3_table_lookup_is_exact():
    """Every byte, with every shift ``d`` the tables encode exactly (0..14) and beyond (zero)."""
    rows, cols = 32, 64
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    packed[:16] = torch.arange(256, dtype=torch.int32).view(4, 64).repeat(4, 1)
    d = torch.arange(rows * cols // 16, dtype=torch.int32).view(rows, cols // 16) % 21
    out = torch.empty(rows, 2 * cols, dtype=torch.float8_e4m3fn, device=DEVICE)
    p8 = packed.to(torch.uint8).to(DEVICE)
    _e4m3_kernel[(1,)](p8, d.to(DEVICE), out, USE_ASM=HAS_CUDA, R=rows, C=cols)
    got = out.float().cpu()
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(rows, 2 * cols)
    shift = d.repeat_interleave(32, dim=1).float()
    want = e2m1_values(nibbles.long()) * torch.exp2(6 - shift)
    want = torch.where(shift > 14, torch.zeros_like(want), want)
    assert torch.equal(got, want)


FAMILY_SMALL = {
    "fp8-lut-swap": MoeTiles(16, 64, 4, 1, mma="fp8", swap_ab=True, lut=True, down_block_n=32),
    "fp8-lut": MoeTiles(16, 64, 4, 1, mma="fp8", lut=True, down_block_n=32),
    "fp8-half-swap": MoeTiles(16, 64, 4, 1, mma="fp8", swap_ab=True, down_block_n=32),
    "fp16": MoeTiles(16, 64, 4, 1, mma="fp16", down_block_n=32),
}
FAMILY_REAL = {
    "fp8-lut-decode": MoeTiles(16, 128, 8, 4, mma="fp8", swap_ab=True, lut=True),
    "fp8-lut-decode-n256": MoeTiles(16, 256, 8, 4, mma="fp8", swap_ab=True, lut=True),
    "fp8-half-decode": MoeTiles(16, 128, 8, 4, mma="fp8", swap_ab=True),
    "fp16-decode": MoeTiles(16, 128, 8, 4, mma="fp16", swap_ab=True),
    "fp8-lut-prefill-n64": MoeTiles(128, 64, 8, 2, mma="fp8", lut=True, down_block_n=128),
    "fp8-lut-prefill": MoeTiles(128, 128, 8, 2, mma="fp8", lut=True),
    "fp8-lut-64": MoeTiles(64, 128, 8, 3, mma="fp8", lut=True),
    "fp8-half-prefill-n64": MoeTiles(128, 64, 8, 2, mma="fp8", down_block_n=128),
    "fp16-prefill-n64": MoeTiles(128, 64, 8, 2, mma="fp16", down_block_n=128),
}


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
@pytest.mark.parametrize("name", list(FAMILY_REAL))
@pytest.mark.parametrize(
    "case", [cases_for(["fp4_moe_experts"], "real")[i] for i in (0, 3, 6)], ids=str
)
def test_family_real(case, name):
    check_case(_with_tiles(FAMILY_REAL[name]), case, DEVICE)


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


@pytest.mark.parametrize("name", ["fp8-lut-swap", "fp8-half-swap", "fp16"])
def test_scales_far_apart_within_a_block(name):
    tokens, experts, dim, inter = (64, 8, 512, 256) if HAS_CUDA else (6, 3, 128, 128)
    args = _spread_scale_inputs(tokens, experts, dim, inter, seed=11)
    kw = dict(swiglu_limit=10.0, act_quant_group=128)
    want = OPS["fp4_moe_experts"].reference(*args, **kw)
    tiles = FAMILY_SMALL[name]
    if HAS_CUDA:
        tiles = MoeTiles(16, 128, 4, 3, mma=tiles.mma, swap_ab=tiles.swap_ab, lut=tiles.lut)
    got = moe_experts.fp4_moe_experts_tiles(*args, **kw, tiles=tiles)
    spread = want.std()
    assert (got - want).abs().max() <= 0.05 * spread
    assert (got - want).abs().mean() <= 0.005 * spread
