"""EPLB in the middle of a generation over gloo: rebalances between steps move expert weights
between ranks (each rank then holds the checkpoint's weights of its new experts) and change no
output token, nor any logprob bit, with batch-invariant kernels."""

from __future__ import annotations

import os
import re

import pytest
import torch

from deepinfer.engine.checkpoint.loader import load_into, read_tensors
from deepinfer.engine.checkpoint.model_loader import load_model
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.expert_parallel import expert_parallel_layers
from deepinfer.engine.model.model import build_model
from deepinfer.engine.runner.eplb import EplbController
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.engine.testing.lockstep import greedy_lockstep
from deepinfer.parallel import (
    ExpertParallelContext,
    TorchDistributedComm,
    initial_placement,
    spawn,
)

NUM_STEPS, INTERVAL = 5, 2  # rebalances after steps 1 and 3, decodes after each
ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.")


def _decode(model, rank, between_steps=None):
    gen = torch.Generator().manual_seed(rank)
    prompts = {s: torch.randint(2, 500, (n,), generator=gen).tolist() for s, n in enumerate([6, 9])}
    new_tokens = {s: NUM_STEPS for s in prompts}
    traces = greedy_lockstep(model, prompts, new_tokens, NUM_STEPS, between_steps=between_steps)
    return {s: (t.tokens, torch.stack(t.logprobs)) for s, t in traces.items()}


def _worker(rank, world_size, directory):
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1"
    torch.set_num_threads(1)
    config = load_config(directory)
    ctx = ExpertParallelContext(TorchDistributedComm(), num_redundant_experts=1, eplb_window=4)
    model = build_model(config, device="cpu", dtype=torch.float32, expert_parallel=ctx)
    load_into(model, directory, config=config, progress=False)
    eplb = EplbController(model.eval(), INTERVAL)
    rebalanced = []
    ep = _decode(model, rank, lambda step: rebalanced.append(eplb.after_step()))
    single = _decode(load_model(directory, dtype=torch.float32, progress=False).eval(), rank)
    placements = [m.ep.placement.slot_expert for m in expert_parallel_layers(model)]
    routed = {n: t.clone() for n, t in model.state_dict().items() if ROUTED.match(n)}
    return {"ep": ep, "single": single, "placements": placements, "routed": routed,
            "rebalanced": rebalanced}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_v4_config(n_routed_experts=8, num_experts_per_tok=3)
    return make_random_checkpoint(
        tmp_path_factory.mktemp("eplb"), config, quantized=False, float_dtype=torch.float32
    )


def test_rebalance_mid_generation_changes_no_output(checkpoint):
    results = spawn(_worker, 2, str(checkpoint), timeout_s=120)
    assert results[0]["rebalanced"] == [False, True, False, True, False]
    assert results[0]["placements"] == results[1]["placements"]  # every rank agrees
    assert any(p != initial_placement(8, 2, 1).slot_expert for p in results[0]["placements"])
    for got in results:
        for seq, (tokens, logprobs) in got["ep"].items():
            assert tokens == got["single"][seq][0]
            assert torch.equal(logprobs, got["single"][seq][1])
        # the experts a rank holds after the moves carry the checkpoint's weights
        stored = read_tensors(checkpoint, sorted(got["routed"]))
        assert all(torch.equal(got["routed"][n], stored[n].float()) for n in stored)


def test_controller_refuses_layers_without_a_load_window():
    with pytest.raises(ValueError, match="eplb_window > 0"):
        EplbController(torch.nn.Linear(2, 2), 2)
