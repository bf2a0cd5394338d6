"""The expert-parallel model over gloo: ranks holding only their experts' weights decode, in
lockstep, exactly what one process holding every expert decodes for the same sequences
(bitwise with batch-invariant kernels, within 1e-4 logprob without), with uneven and idle ranks,
redundant slots and hash-routed layers."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.engine.checkpoint.loader import load_into
from deepinfer.engine.checkpoint.model_loader import bind_engram_from_tokenizer, load_model
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.lockstep import greedy_lockstep
from deepinfer.parallel import ExpertParallelContext, TorchDistributedComm, spawn

NUM_STEPS = 4  # a prefill and three decodes
# top-3 of 8: with three terms the order of a token's fp32 sum matters, two would commute
ROUTING = {"n_routed_experts": 8, "num_experts_per_tok": 3}
TIMEOUT_S = 120


def _prompts(rank: int, world_size: int) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Rank 0 two sequences, rank 1 one that stops early (then idles), rank 3 none at all."""
    gen = torch.Generator().manual_seed(rank)
    lengths = {0: [5, 9], 1: [7], 2: [4, 3], 3: []}[rank % 4]
    prompts = {
        s: torch.randint(2, 500, (n,), generator=gen).tolist() for s, n in enumerate(lengths)
    }
    new_tokens = {s: 2 if rank == 1 else NUM_STEPS for s in prompts}
    return prompts, new_tokens


def _decode(model, rank, world_size):
    prompts, new_tokens = _prompts(rank, world_size)
    traces = greedy_lockstep(model, prompts, new_tokens, NUM_STEPS)
    return {s: (t.tokens, torch.stack(t.logprobs)) for s, t in traces.items()}


def _worker(rank, world_size, directory, num_redundant, batch_invariant, dtype):
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    torch.set_num_threads(1)
    config = load_config(directory)
    ctx = ExpertParallelContext(TorchDistributedComm(), num_redundant_experts=num_redundant)
    model = build_model(config, device="cpu", dtype=dtype, expert_parallel=ctx)
    load_into(model, directory, config=config, progress=False)
    bind_engram_from_tokenizer(model, directory)
    held = [len(m.experts) for m in model.modules() if getattr(m, "ep", None) is not None]
    expert_parallel = _decode(model.eval(), rank, world_size)
    single = load_model(directory, dtype=dtype, progress=False).eval()
    return {"held": held, "ep": expert_parallel, "single": _decode(single, rank, world_size)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {
        # unquantised fp32: expert outputs use every fp32 bit, so summation order shows
        "v4": make_random_checkpoint(
            root / "v4",
            tiny_v4_config(**ROUTING),
            quantized=False,
            seed=1,
            float_dtype=torch.float32,
        ),
        "v41": make_random_checkpoint(
            root / "v41", tiny_v41_config(vision=False, **ROUTING), quantized=True, seed=2
        ),
    }


@pytest.mark.parametrize(("arch", "world_size", "num_redundant"), [("v4", 2, 1), ("v41", 4, 1)])
def test_ep_decode_is_bitwise_the_single_process_one(checkpoints, arch, world_size, num_redundant):
    results = spawn(
        _worker,
        world_size,
        str(checkpoints[arch]),
        num_redundant,
        True,
        torch.float32,  # fp32 experts: a wrong summation order shows in the last bit
        timeout_s=TIMEOUT_S,
    )
    num_experts = load_config(checkpoints[arch]).n_routed_experts
    for rank, got in enumerate(results):
        # each rank holds its share plus its redundant slots, never every expert
        assert set(got["held"]) == {num_experts // world_size + num_redundant}
        assert got["ep"].keys() == got["single"].keys()
        for seq, (tokens, logprobs) in got["ep"].items():
            single_tokens, single_logprobs = got["single"][seq]
            assert tokens == single_tokens, (rank, seq)
            assert torch.equal(logprobs, single_logprobs), (rank, seq)


def test_ep_decode_without_batch_invariance_agrees_within_1e4(checkpoints):
    results = spawn(
        _worker, 2, str(checkpoints["v4"]), 0, False, torch.float32, timeout_s=TIMEOUT_S
    )
    for got in results:
        for seq, (tokens, logprobs) in got["ep"].items():
            single_tokens, single_logprobs = got["single"][seq]
            assert tokens == single_tokens
            assert (logprobs - single_logprobs).abs().max() <= 1e-4
