"""The engine core driving the real tiny V4 model on CPU (fp32, reference ops).

The engine's ``ModelRunner`` over a model built in memory (no checkpoint) shows the step
boundary carries enough for the real model: with ``DEEPINFER_BATCH_INVARIANT=1`` greedy outputs are identical alone,
batched, chunked and under preemption, and equal a plain loop over full forwards.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.core import EngineCore, Request, Scheduler, SchedulerConfig
from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.fake_executor import run_until_done
from deepinfer.sampling import SamplingParams

BLOCK_SIZE = 128


def _runner(model, num_blocks: int, num_slots: int) -> ModelRunner:
    layout = CacheLayout(num_blocks=num_blocks, num_slots=num_slots, block_size=BLOCK_SIZE)
    return ModelRunner(model, ModelCache(model.config, layout, dtype=torch.float32))


def _tiny_model(raw: dict):
    m = build_model(parse_config(raw), device="cpu", dtype=torch.float32)
    fill_dummy(m, seed=0)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return _tiny_model(tiny_v4_config(vocab_size=256))


@pytest.fixture(scope="module")
def model_v41():
    torch.set_num_threads(1)
    raw = tiny_v41_config(vision=False)
    m = _tiny_model(raw)
    gen = torch.Generator().manual_seed(1)
    compressed_vocab = raw["text_config"]["engram_compressed_vocab_size"]
    m.bind_engram(torch.randint(0, compressed_vocab, (m.config.vocab_size,), generator=gen))
    return m


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _prompts(lengths: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in lengths]


# two prompts end just before a block boundary, so decoding needs a second block
LENGTHS = [127, 40, 128, 9]


def _generate(model, prompts, params, *, num_blocks=16, budget=512, max_seqs=8):
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=4 * BLOCK_SIZE,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_state_slots=max_seqs + 1,
    )
    core = EngineCore(Scheduler(config), _runner(model, num_blocks, max_seqs + 1))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(str(i), prompt, p, seed=p.seq_seed))
    tokens: dict[tuple[str, int], list[int]] = {}
    for u in run_until_done(core):
        tokens.setdefault((u.group_id, u.index), []).extend(u.new_token_ids)
    return tokens, core.scheduler.num_preemptions


@torch.no_grad()
def _plain_loop(model, prompt: list[int], output: list[int]) -> list[int]:
    """The greedy tokens a loop of full forwards over the whole context would pick after
    ``prompt``, checked along ``output``: one causal forward over prompt + output (batch-invariant
    ops), the argmax at each generating position. Equal to ``output`` exactly when re-running
    the forward token by token would give it."""
    tokens = list(prompt) + list(output[:-1])
    n = len(tokens)
    cache = ModelCache(model.config, CacheLayout(4, 1, BLOCK_SIZE), dtype=torch.float32)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n]),
        block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
        state_slots=torch.tensor([0]),
        logits_indices=torch.arange(len(prompt) - 1, n),
    )
    return model(batch, cache).argmax(-1).tolist()


@pytest.mark.slow
def test_greedy_engine_outputs_equal_the_plain_loop_batched_chunked_preempted(model):
    # the plain loop runs each prompt alone, so equality also means batched == alone
    prompts = _prompts(LENGTHS)
    n = len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seq_seed=1)] * n
    together, _ = _generate(model, prompts, params)
    assert all(len(together[(str(i), 0)]) == 3 for i in range(n))
    expected = {
        (str(i), 0): _plain_loop(model, p, together[(str(i), 0)]) for i, p in enumerate(prompts)
    }
    assert together == expected
    chunked, _ = _generate(model, prompts, params, budget=37)
    assert chunked == expected
    preempted, num_preemptions = _generate(model, prompts, params, num_blocks=4, budget=200)
    assert num_preemptions > 0 and preempted == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_seeded_n_samples_fork_on_the_real_cache(arch, request):
    model = request.getfixturevalue("model" if arch == "v4" else "model_v41")
    prompt = _prompts([137])[0]  # block 1 already holds complete compressed entries
    p = SamplingParams(temperature=1.0, n=3, max_tokens=4, ignore_eos=True, seq_seed=99)
    forked, _ = _generate(model, [prompt], [p])
    # each sample alone, seeded like the fork gives it, without sharing anything
    from deepinfer.engine.core.request import child_seed

    for k in range(3):
        alone_params = SamplingParams(
            temperature=1.0, max_tokens=4, ignore_eos=True, seq_seed=child_seed(99, k)
        )
        alone, _ = _generate(model, [prompt], [alone_params])
        assert forked[("0", k)] == alone[("0", 0)]
    assert len({tuple(forked[("0", k)]) for k in range(3)}) > 1


@pytest.mark.slow
def test_v41_greedy_outputs_equal_the_plain_loop_chunked_and_preempted(model_v41):
    prompts = _prompts([127, 20])
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seq_seed=1)] * 2
    chunked, _ = _generate(model_v41, prompts, params, budget=50)
    assert all(len(chunked[(str(i), 0)]) == 3 for i in range(2))
    expected = {
        (str(i), 0): _plain_loop(model_v41, p, chunked[(str(i), 0)]) for i, p in enumerate(prompts)
    }
    assert chunked == expected
    preempted, num_preemptions = _generate(model_v41, prompts, params, num_blocks=3)
    assert num_preemptions > 0 and preempted == expected
