"""An expert-parallel MoE layer in a world of one rank (dispatch, slots, combine all run, with a
redundant slot replicating an expert) against the plain layer: bitwise with batch-invariant
kernels, on the host loop and on the grouped FP4 op (forced on the CPU); on a GPU, the grouped
op within the grouped test's bounds."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.expert_parallel import expert_parallel_layers
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.moe import MoE
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.parallel import ExpertParallelContext, SingleProcessComm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    raw = tiny_v4_config(n_routed_experts=8, num_experts_per_tok=3)
    path = make_random_checkpoint(tmp_path_factory.mktemp("ep1"), raw, quantized=True)
    config = load_config(path)
    ctx = ExpertParallelContext(SingleProcessComm(), num_redundant_experts=1)
    built = []
    for expert_parallel in (None, ctx):
        model = build_model(
            config, device="cpu", dtype=torch.bfloat16, expert_parallel=expert_parallel
        )
        load_into(model, path, config=config, progress=False)
        built.append(model.eval())
    return built


def _pairs(models):
    plain = [m for m in models[0].modules() if isinstance(m, MoE)]
    parallel = expert_parallel_layers(models[1])
    assert len(plain) == len(parallel) == models[0].config.num_layers
    return list(zip(plain, parallel))[:2]  # the hash-routed layer and a score-routed one


def _compare(models, device, grouped, exact):
    config = models[0].config
    gen = torch.Generator().manual_seed(3)
    for plain, parallel in _pairs(models):
        x = torch.randn(13, config.hidden_size, generator=gen).bfloat16().to(device)
        ids = torch.randint(0, config.vocab_size, (13,), generator=gen).to(device)
        plain.grouped_experts = parallel.grouped_experts = grouped
        want, got = plain(x, ids), parallel(x, ids)
        if exact:
            assert torch.equal(got, want)
        else:
            scale = want.float().abs().max()
            assert (got.float() - want.float()).abs().max() <= 0.05 * scale


@pytest.mark.parametrize("grouped", [False, True])
def test_one_rank_ep_layer_is_bitwise_the_plain_layer(models, grouped, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    slots = expert_parallel_layers(models[1])[0].ep
    assert slots.slot_experts == (*range(8), 0)  # the redundant slot replicates expert 0
    _compare(models, "cpu", grouped, exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_ep_layer_on_gpu(models):
    gpu = [m.to("cuda") for m in models]  # the routing tables follow on first use
    try:
        _compare(gpu, "cuda", None, exact=False)
    finally:
        for m in models:
            m.to("cpu")
