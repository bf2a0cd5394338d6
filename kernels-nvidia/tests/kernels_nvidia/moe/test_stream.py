"""The stream kernels with decode tiles (``MoeTiles.mma`` "mx" and "split") against the
reference: the conformance cases (small under the interpreter, model shapes on the GPU), weights
whose 32-column scales spread over many octaves within a row, and the decode choice of
``choose_tiles``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.kernels import OPS
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia.moe import experts as moe_experts
from deepinfer.kernels_nvidia.moe.experts import MoeTiles

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")

SMALL = {
    "mx": MoeTiles(16, 64, 4, 1, mma="mx", block_k=32, down_block_n=32),
    "mx-k256": MoeTiles(16, 64, 8, 1, mma="mx", block_k=256),
    "mx-swap": MoeTiles(16, 64, 4, 1, mma="mx", swap_ab=True, block_k=64, down_block_n=32),
}
# every decode variant bench_moe.py sweeps (the default is also in test_ops.py's conformance cases)
REAL = {
    "decode-default": moe_experts.DECODE_TILES,
    "decode-default-small-group": moe_experts.DECODE_TILES_SMALL_GROUP,
    "mx-n128-k256-w8s4": MoeTiles(16, 128, 8, 4, mma="mx", block_k=256),
    "mx-n128-k128-w4s4": MoeTiles(16, 128, 4, 4, mma="mx", block_k=128),
    "mx-n128-k128-w8s4": MoeTiles(16, 128, 8, 4, mma="mx", block_k=128),
    "mx-n256-k128-w8s3": MoeTiles(16, 256, 8, 3, mma="mx", block_k=128),
    "mx-n128-k256-w8s3-down-n256": MoeTiles(16, 128, 8, 3, mma="mx", block_k=256, down_block_n=256),
    "mx-swap-n128-k128-w4s4": MoeTiles(16, 128, 4, 4, mma="mx", swap_ab=True, block_k=128),
    "mx-n128-k256-w8s3-fence": MoeTiles(
        16, 128, 8, 3, mma="mx", block_k=256, group_m=0, wgmma_fence=True
    ),  # fmt: skip
}


SPLIT_SMALL = {
    "split-swap": MoeTiles(16, 64, 4, 1, mma="split", swap_ab=True, block_k=64, down_block_n=32),
    "split": MoeTiles(16, 32, 4, 1, mma="split", block_k=32),
    "split-fused": MoeTiles(16, 32, 4, 1, mma="split", swap_ab=True, block_k=32,
                            fused_gate_up=True),
    "mx-then-split-down": MoeTiles(16, 64, 4, 1, mma="mx", block_k=32, group_m=0,
                                   down=MoeTiles(16, 64, 4, 1, mma="split", swap_ab=True,
                                                 block_k=64)),
}  # fmt: skip


def _split(block_n, block_k, warps, stages, **kw):
    return MoeTiles(16, block_n, warps, stages, mma="split", swap_ab=True, block_k=block_k,
                    group_m=0, wgmma_fence=True, **kw)  # fmt: skip


# the split shapes bench_moe.py sweeps for decode
_DOWN = moe_experts.SPLIT_DOWN_TILES
SPLIT_REAL = {
    "split-n128-k128-w4s4": _split(128, 128, 4, 4),
    "split-n128-k128-w8s4": _split(128, 128, 8, 4),
    "split-fused-n128-k128-w8s3": _split(128, 128, 8, 3, fused_gate_up=True, down=_DOWN),
    "split-fused-n128-k64-w4s4": _split(128, 64, 4, 4, fused_gate_up=True, down=_DOWN),
    "split-fused-n64-k128-w4s4": _split(64, 128, 4, 4, fused_gate_up=True, down=_DOWN),
    "mx-then-split-down-n64": dataclasses.replace(moe_experts.DECODE_TILES,
                                                  down=_split(64, 128, 4, 4)),
}  # fmt: skip


SMALL |= SPLIT_SMALL
REAL |= SPLIT_REAL


def _with_tiles(tiles):
    def run(*args, **kwargs):
        return moe_experts.fp4_moe_experts_tiles(*args, **kwargs, tiles=tiles)

    return run


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("case", cases_for(["fp4_moe_experts"], "small"), ids=str)
def test_stream_small(case, name):
    check_case(_with_tiles(SMALL[name]), case, DEVICE)


def _decode_cases():
    return [c for c in cases_for(["fp4_moe_experts"], "real") if "64t-" in c.name]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("case", _decode_cases(), ids=str)
def test_stream_real(case, name):
    check_case(_with_tiles(REAL[name]), case, DEVICE)


def _spread_scale_inputs(experts, dim, inter, gen, max_drop=10):
    """Expert inputs whose weight scales vary by up to 2^max_drop within each row."""
    g = torch.Generator(device=DEVICE).manual_seed(
        int(torch.randint(0, 2**31, (1,), generator=gen))
    )
    x = torch.randn(5, dim, generator=g, device=DEVICE).bfloat16()
    ids = torch.rand(5, experts, generator=g, device=DEVICE).topk(2, dim=-1).indices
    weights = torch.rand(5, 2, generator=g, device=DEVICE) + 0.25
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), DEVICE)
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), DEVICE)

    def spread(scale):  # each group's exponent lowered by 0..max_drop
        drop = torch.randint(
            0, max_drop + 1, scale.shape, generator=g, device=DEVICE, dtype=torch.int32
        )
        return (scale.view(torch.uint8).int() - drop).to(torch.uint8).view(torch.float8_e8m0fnu)

    return x, weights, ids, w13, spread(s13), w2, spread(s2)


@pytest.mark.parametrize(
    ("name", "max_drop", "seed"),
    [
        ("mx", 10, 3),
        ("split-swap", 12, 7),
        ("split-fused", 12, 7),
    ],
)
def test_stream_scales_spread_within_a_row(name, max_drop, seed):
    args = _spread_scale_inputs(4, 128, 64, torch.Generator().manual_seed(seed), max_drop)
    kw = dict(swiglu_limit=10.0, act_quant_group=32)
    want = OPS["fp4_moe_experts"].reference(*args, **kw)
    got = _with_tiles(SMALL[name])(*args, **kw)
    assert ((got - want).abs().max() / want.std()).item() < 2e-2


def test_decode_batches_choose_a_stream_family():
    decode = moe_experts.choose_tiles(64 * 6, 256, batch_invariant=False, on_cpu=False)
    assert decode == moe_experts.DECODE_TILES
    assert decode.mma in moe_experts.STREAM_FAMILIES
    for group, want in ((128, moe_experts.DECODE_TILES), (None, moe_experts.DECODE_TILES),
                        (32, moe_experts.DECODE_TILES_SMALL_GROUP)):  # fmt: skip
        got = moe_experts.choose_tiles(64 * 6, 384, batch_invariant=False, on_cpu=False,
                                       act_quant_group=group)  # fmt: skip
        assert got == want
    small = moe_experts.DECODE_TILES_SMALL_GROUP
    assert small.fused_gate_up and small.mma == "split" and small.down.mma == "split"
    for group in (None, 32, 128):
        invariant = moe_experts.choose_tiles(64 * 6, 256, batch_invariant=True, on_cpu=False,
                                             act_quant_group=group)  # fmt: skip
        assert invariant == moe_experts.BATCH_INVARIANT_TILES
