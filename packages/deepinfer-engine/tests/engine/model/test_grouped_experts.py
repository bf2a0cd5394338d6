"""The grouped FP4-expert path of the MoE layer (one ``fp4_moe_experts`` call) against the
reference host loop over experts, on a quantised tiny checkpoint: same routing, outputs equal up
to the fp32 summation order and the bf16 rounding of the gate/up outputs; the stacked weights
are the experts' own parameters (views), so loading into them after stacking still counts."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.moe import MoE, stack_grouped_experts
from deepinfer.engine.testing import random_checkpoint
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request, tmp_path_factory):
    raw = tiny_v4_config() if request.param == "v4" else tiny_v41_config(vision=False)
    path = tmp_path_factory.mktemp(request.param)
    random_checkpoint.make_random_checkpoint(path, raw, quantized=True, float_dtype=torch.float32)
    config = load_config(path)
    module = build_model(config, device="cpu", dtype=torch.bfloat16)
    load_into(module, path, config=config, progress=False)
    return module.eval()


def _moe_layers(model) -> list[MoE]:
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and layers[0].experts[0].w1.fmt == "fp4"
    return layers


def _both_paths(moe: MoE, x, ids):
    moe.grouped_experts = False
    looped = moe(x, ids)
    moe.grouped_experts = True
    grouped = moe(x, ids)
    moe.grouped_experts = None
    return looped, grouped


def test_grouped_matches_loop(model):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    for moe in _moe_layers(model):
        device = moe.gate.weight.device
        x = torch.randn(37, model.config.hidden_size, generator=gen).bfloat16().to(device)
        ids = torch.randint(0, vocab, (37,), generator=gen).to(device)
        looped, grouped = _both_paths(moe, x, ids)
        assert grouped.dtype == looped.dtype == torch.bfloat16
        scale = looped.float().abs().max()
        assert scale > 0
        diff = (grouped.float() - looped.float()).abs()
        # both round each expert's output to bf16; the order of the fp32 sum and the gate/up
        # rounding differ: a few bf16 ulps of the largest output at most
        assert diff.max() <= 0.05 * scale, (diff.max(), scale)
        assert diff.mean() <= 0.005 * scale


def test_stacked_weights_are_the_parameters(model):
    moe = _moe_layers(model)[0]
    w13, w13_scale, w2, _ = moe.stacked_experts()
    inter = moe.experts[0].w1.out_features
    assert w13.shape[:2] == (len(moe.experts), 2 * inter)
    last = moe.experts[-1]
    assert torch.equal(w13[-1, inter:].view(torch.uint8), last.w3.weight.view(torch.uint8))
    assert torch.equal(w2[-1], last.w2.weight)
    assert last.w3.weight.data_ptr() == w13[-1, inter:].data_ptr()
    # a later in-place load reaches the stack the op reads
    before = w13_scale[-1, 0].clone()
    fresh = torch.randint(0, 256, last.w1.weight.shape, dtype=torch.uint8).view(torch.int8)
    saved = last.w1.weight.clone()
    last.w1.weight.copy_(fresh)
    assert torch.equal(moe.stacked_experts()[0][-1, :inter], fresh)
    last.w1.weight.copy_(saved)
    assert torch.equal(w13_scale[-1, 0].view(torch.uint8), before.view(torch.uint8))


def test_auto_choice_and_stacking_pass(model):
    moe = _moe_layers(model)[0]
    assert not moe.uses_grouped_experts(torch.device("cpu"))
    assert moe.uses_grouped_experts(torch.device("cuda"))
    assert stack_grouped_experts(model, torch.device("cpu")) == 0
    moe.grouped_experts = True
    try:
        assert stack_grouped_experts(model, torch.device("cpu")) == 1
    finally:
        moe.grouped_experts = None


def test_grouped_refuses_dense_experts(tmp_path):
    config = load_config(random_checkpoint.make_random_checkpoint(
        tmp_path, tiny_v4_config(), quantized=False, float_dtype=torch.float32
    ))  # fmt: skip
    moe = next(m for m in build_model(config, device="meta").modules() if isinstance(m, MoE))
    assert not moe.uses_grouped_experts(torch.device("cuda"))
    moe.grouped_experts = True
    with pytest.raises(ValueError, match="grouped_experts=True needs FP4 experts"):
        moe.uses_grouped_experts(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_matches_loop_on_gpu(model):
    """The engine's default on a GPU (the Triton grouped op) against the loop on the GPU."""
    gpu = model.to("cuda")
    try:
        test_grouped_matches_loop(gpu)
        moe = _moe_layers(gpu)[0]
        assert moe.uses_grouped_experts(torch.device("cuda"))
        assert moe.stacked_experts()[0].is_cuda
    finally:
        model.to("cpu")
