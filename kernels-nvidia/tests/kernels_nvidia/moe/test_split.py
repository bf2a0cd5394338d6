"""The split family's even/odd-split MXFP4 upcast (``MoeTiles.mma="split"``): the bit-placed
nibbles against the reference dequantisation (every byte value, scales over the whole ue8m0
range the upcast supports), and the validation of the split tiles. The expert op with split
tiles against the reference is in test_stream.py with the "mx" family."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference import quant as ref_quant
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia.moe import experts as moe_experts
from deepinfer.kernels_nvidia.moe.experts import MoeTiles
from deepinfer.kernels_nvidia.moe.split import nibbles_to_bf16_scaled, split_factor

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@triton.jit
def _upcast_kernel(p_ptr, s_ptr, r_ptr, lo_ptr, hi_ptr, USE_ASM: tl.constexpr,
                   ROWS: tl.constexpr, BYTES: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BYTES)
    offsets = rows[:, None] * BYTES + cols[None, :]
    packed = tl.load(p_ptr + offsets).to(tl.uint8, bitcast=True)
    scales = tl.load(s_ptr + rows[:, None] * (BYTES // 16) + tl.arange(0, BYTES // 16)[None, :])
    factor = split_factor(scales, tl.load(r_ptr + rows))
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (ROWS, BYTES // 16, 16)),
                        (ROWS, BYTES))  # fmt: skip
    lo, hi = nibbles_to_bf16_scaled(packed, factor, USE_ASM)
    tl.store(lo_ptr + offsets, lo)
    tl.store(hi_ptr + offsets, hi)


def _check_upcast(scale_low, scale_high, use_asm, seed):
    """Every byte value; scale exponents drawn from ``[scale_low, scale_high]``; each row's
    reference exponent is its largest scale."""
    rows, nbytes = 16, 256
    gen = torch.Generator().manual_seed(seed)
    packed = torch.arange(256, dtype=torch.int32)[torch.randperm(256, generator=gen)]
    packed = packed.repeat(rows, 1)[:, :nbytes].to(torch.uint8).view(torch.int8)
    scales = torch.randint(scale_low, scale_high + 1, (rows, nbytes // 16), generator=gen)
    scales = scales.to(torch.uint8)
    row_ref = scales.int().amax(1)
    lo = torch.empty(rows, nbytes, dtype=torch.bfloat16, device=DEVICE)
    hi = torch.empty_like(lo)
    _upcast_kernel[(1,)](packed.to(DEVICE), scales.to(DEVICE), row_ref.to(DEVICE), lo, hi,
                         USE_ASM=use_asm, ROWS=rows, BYTES=nbytes)  # fmt: skip
    want = ref_quant.fp4_dequant(packed, scales.view(torch.float8_e8m0fnu), 32).double()
    want = want * torch.exp2(127.0 - row_ref[:, None].double())
    got = torch.stack([lo.cpu().double(), hi.cpu().double()], -1).reshape(rows, 2 * nbytes)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("low", "high"), [(110, 125), (2, 12), (236, 250), (100, 110)])
def test_split_upcast_is_exact(low, high):
    _check_upcast(low, high, use_asm=False, seed=low)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("low", "high"), [(110, 125), (2, 12), (236, 250), (100, 110)])
def test_split_upcast_inline_asm_is_exact(low, high):
    """The GPU's bit placement and bf16x2 multiply: subnormal nibbles (0.5) kept, not flushed."""
    _check_upcast(low, high, use_asm=True, seed=low)


def _small_inputs(seed):
    """Small expert inputs (weight scales dropping by up to 2^12 within each row)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    experts, dim, inter = 4, 128, 64
    x = torch.randn(5, dim, generator=g, device=DEVICE).bfloat16()
    ids = torch.rand(5, experts, generator=g, device=DEVICE).topk(2, dim=-1).indices
    weights = torch.rand(5, 2, generator=g, device=DEVICE) + 0.25
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), DEVICE)
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), DEVICE)

    def spread(scale):
        drop = torch.randint(0, 13, scale.shape, generator=g, device=DEVICE, dtype=torch.int32)
        return (scale.view(torch.uint8).int() - drop).to(torch.uint8).view(torch.float8_e8m0fnu)

    return x, weights, ids, w13, spread(s13), w2, spread(s2)


@pytest.mark.parametrize(
    "tiles",
    [
        MoeTiles(16, 64, 4, 1, mma="mx", fused_gate_up=True),
        MoeTiles(16, 64, 4, 1, mma="mx", down=MoeTiles(32, 64, 4, 1, mma="split")),
        MoeTiles(16, 64, 4, 1, mma="bf16", down=MoeTiles(16, 64, 4, 1, mma="split")),
    ],
    ids=["fused-needs-split", "down-block-m", "down-needs-stream-family"],
)
def test_split_tiles_are_validated(tiles):
    args = _small_inputs(1)
    with pytest.raises(ValueError, match="tiles"):
        moe_experts.fp4_moe_experts_tiles(*args, swiglu_limit=10.0, act_quant_group=32,
                                          tiles=tiles)  # fmt: skip
