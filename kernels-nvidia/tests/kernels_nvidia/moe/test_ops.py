"""MoE kernels (routing, clamped SwiGLU, FP4 routed experts) against the reference through the
conformance kit, batch invariance, no host sync and contract errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.moe_kernels import random_fp4_weight
from deepinfer.kernels_nvidia.moe import experts as moe_experts
from deepinfer.kernels_nvidia.moe import route as moe_route
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
OPS_HERE = ["route_topk", "route_hash", "swiglu_clamped", "fp4_moe_experts"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


def test_moe_kernels_are_registered():
    assert IMPLEMENTATIONS["route_topk"] is moe_route.route_topk
    assert IMPLEMENTATIONS["fp4_moe_experts"] is moe_experts.fp4_moe_experts


@pytest.mark.parametrize("case", cases_for(OPS_HERE, "small"), ids=str)
def test_conformance_small(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS_HERE, "real"), ids=str)
def test_conformance_real(case):
    check_case(IMPLEMENTATIONS[case.op], case, DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_rounds_as_a_separate_cast(dtype):
    """``out_dtype`` rounds in the store exactly as ``.to`` rounds the fp32 result."""
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(5, 96, generator=gen).mul(6).to(DEVICE, dtype) for _ in range(2))
    wide = moe_route.swiglu_clamped(gate, up, 10.0)
    narrow = moe_route.swiglu_clamped(gate, up, 10.0, out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.to(torch.bfloat16))
    half = moe_route.swiglu_clamped(gate, up, 10.0, out_dtype=torch.float16)
    assert torch.equal(half, wide.to(torch.float16))


def _moe_inputs(tokens, experts, dim, inter, top_k, gen):
    g = torch.Generator(device=DEVICE).manual_seed(
        int(torch.randint(0, 2**31, (1,), generator=gen))
    )
    x = torch.randn(tokens, dim, generator=g, device=DEVICE).bfloat16()
    ids = torch.rand(tokens, experts, generator=g, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    w13, s13 = random_fp4_weight(g, (experts, 2 * inter, dim), DEVICE)
    w2, s2 = random_fp4_weight(g, (experts, dim, inter), DEVICE)
    return x, weights, ids, w13, s13, w2, s2


@pytest.mark.parametrize("group", [128, 32])
def test_batch_invariance(group, monkeypatch):
    """With DEEPINFER_BATCH_INVARIANT=1 a token's output is bitwise identical for every batch."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    if HAS_CUDA:
        experts, dim, inter, sizes = (256, 4096, 2048, (1, 7, 64, 1000))
    else:
        experts, dim, inter, sizes = (4, 128, 128, (1, 7, 20))
    x, w, ids, w13, s13, w2, s2 = _moe_inputs(max(sizes), experts, dim, inter, 6 if HAS_CUDA else 2,
                                              torch.Generator().manual_seed(group))  # fmt: skip
    rows = [
        moe_experts.fp4_moe_experts(x[:n], w[:n], ids[:n], w13, s13, w2, s2,
                                    swiglu_limit=10.0, act_quant_group=group)[0]
        for n in sizes
    ]  # fmt: skip
    for row in rows[1:]:
        assert torch.equal(row, rows[0])


@pytest.mark.gpu
@gpu
def test_experts_and_routing_never_sync_with_the_host():
    x, w, ids, w13, s13, w2, s2 = _moe_inputs(
        64, 256, 512, 256, 6, torch.Generator().manual_seed(5)
    )
    logits = torch.randn(64, 256, device=DEVICE)
    moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, swiglu_limit=10.0, act_quant_group=128)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_route.route_topk(logits, None, 6, scoring_func="sqrtsoftplus", route_scale=1.5,
                             norm_eps=0.0, renormalize=True)  # fmt: skip
        moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, swiglu_limit=10.0,
                                    act_quant_group=128)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_route_batch_invariance():
    logits = torch.randn(64, 256, device=DEVICE)
    bias = torch.randn(256, device=DEVICE) * 0.1
    kw = dict(scoring_func="sqrtsoftplus", route_scale=1.5, norm_eps=0.0, renormalize=True)
    w_all, ids_all = moe_route.route_topk(logits, bias, 6, **kw)
    w_one, ids_one = moe_route.route_topk(logits[5:6], bias, 6, **kw)
    assert torch.equal(w_all[5], w_one[0]) and torch.equal(ids_all[5], ids_one[0])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_shared_rows_and_rounding_in_the_combine_equal_separate_ops(out_dtype):
    """``shared`` added in the combine and the result stored in ``out_dtype`` equal the fp32
    result then ``+ shared.float()`` then ``.to`` bit for bit (the engine's former three ops;
    fp16 rounds after the combine)."""
    shape = (40, 256, 1024, 512, 6) if HAS_CUDA else (9, 4, 128, 128, 2)
    tokens, experts, dim, inter, top_k = shape
    x, w, ids, w13, s13, w2, s2 = _moe_inputs(tokens, experts, dim, inter, top_k,
                                              torch.Generator().manual_seed(8))  # fmt: skip
    shared = (torch.randn(tokens, dim, device=DEVICE) * 4).bfloat16()
    kw = dict(swiglu_limit=10.0, act_quant_group=128)
    wide = moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, **kw)
    got = moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, shared=shared,
                                      out_dtype=out_dtype, **kw)  # fmt: skip
    assert got.dtype == out_dtype and torch.equal(got, (wide + shared.float()).to(out_dtype))
    alone = moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, out_dtype=out_dtype, **kw)
    assert torch.equal(alone, wide.to(out_dtype))
    with pytest.raises(ValueError, match=r"shared: expected shape \("):
        moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2, shared=shared[:-1], **kw)


def test_rejects_weights_of_the_wrong_shape():
    x, w, ids, w13, s13, w2, s2 = _moe_inputs(3, 4, 64, 64, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="w2_scale"):
        moe_experts.fp4_moe_experts(x, w, ids, w13, s13, w2, s2[:, :, :1],
                                    swiglu_limit=10.0, act_quant_group=32)  # fmt: skip


def test_rejects_unknown_scoring():
    with pytest.raises(ValueError, match="scoring_func='tanh'"):
        moe_route.route_topk(torch.randn(2, 8, device=DEVICE), None, 2, scoring_func="tanh",
                             route_scale=1.0, norm_eps=0.0, renormalize=True)  # fmt: skip
