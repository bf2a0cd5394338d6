"""The engine core driving the real tiny V4 model on CPU (fp32, reference ops).

A minimal torch executor written here from ``RunnerState`` / ``build_step_plan`` (what the
model runner will do, without its performance work) shows the step boundary carries enough
for the real model: with ``DEEPINFER_BATCH_INVARIANT=1`` greedy outputs are identical alone,
batched, chunked and under preemption, and equal a plain loop over full forwards.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.core import EngineCore, Request, Scheduler, SchedulerConfig
from deepinfer.engine.core.batch_plan import RunnerState, build_step_plan
from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.core.testing import run_until_done
from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config import parse_config
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.sampling import SamplingParams, sample

BLOCK_SIZE = 128
PER_SLOT = ("window", "_kv", "_score")  # state-slot tensors: "{layer}.window", "*comp_kv", ...
PER_BLOCK = (".kv", ".index_keys")  # arena tensors


class TorchExecutor:
    """Runs scheduled steps on a real model with a real cache (test-only runner)."""

    def __init__(self, model, num_blocks: int, num_slots: int) -> None:
        self.model = model
        layout = CacheLayout(num_blocks=num_blocks, num_slots=num_slots, block_size=BLOCK_SIZE)
        self.cache = ModelCache(model.config, layout, dtype=torch.float32)
        self.state = RunnerState()

    def _copy_rows(self, pairs, per_block: bool) -> None:
        """Copy whole blocks (arena tensors) or whole state slots (rings, compressor state,
        Engram history) from source to destination ids."""
        count = self.cache.layout.num_blocks if per_block else self.cache.layout.num_slots
        tensors = dict(self.cache.tensors)
        if not per_block:
            tensors.update({f"extra.{k}": v for k, v in self.cache.extra.items()})
        for name, t in tensors.items():
            is_block = name.endswith(PER_BLOCK) and "comp" not in name
            is_slot = name.endswith(PER_SLOT) or name.startswith("extra.")
            if is_block != per_block or not (is_block or is_slot):
                continue
            rows = t.shape[0] // count
            for src, dst in pairs:
                t[dst * rows : (dst + 1) * rows] = t[src * rows : (src + 1) * rows]

    @torch.no_grad()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.state.apply(so)
        self._copy_rows(so.block_copies, per_block=True)
        self._copy_rows(so.state_copies, per_block=False)
        plan = build_step_plan(self.state, so)
        rows, sample_at, _ = plan.logits_layout()
        long = dict(dtype=torch.long)
        batch = ForwardBatch(
            input_ids=torch.tensor(plan.input_ids, **long),
            positions=torch.tensor(plan.positions, **long),
            cu_seqlens_q=torch.tensor(plan.cu_seqlens_q, dtype=torch.int32),
            seq_lens=torch.tensor(plan.seq_lens, **long),
            block_tables=torch.tensor(plan.block_tables, dtype=torch.int32),
            state_slots=torch.tensor(plan.state_slots, **long),
            logits_indices=torch.tensor(rows, **long),
        )
        logits = self.model(batch, self.cache)
        params = [
            replace(p, seq_seed=seed, seed=None)
            for p, seed in zip(plan.sample_params(self.state), plan.sample_seeds)
        ]
        tokens = sample(logits[sample_at], params, plan.sample_positions).token_ids.tolist()
        out = ModelRunnerOutput()
        for s, b in enumerate(plan.sample_requests):
            out.sampled_token_ids.setdefault(plan.request_ids[b], []).append(tokens[s])
        return out


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
    core = EngineCore(Scheduler(config), TorchExecutor(model, num_blocks, max_seqs + 1))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(Request(str(i), prompt, p, seed=p.seq_seed))
    tokens: dict[tuple[str, int], list[int]] = {}
    for u in run_until_done(core):
        tokens.setdefault((u.group_id, u.index), []).extend(u.new_token_ids)
    return tokens, core.scheduler.num_preemptions


@torch.no_grad()
def _plain_loop(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by a full forward over the whole context for every token."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        cache = ModelCache(model.config, CacheLayout(4, 1, BLOCK_SIZE), dtype=torch.float32)
        n = len(tokens)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens),
            positions=torch.arange(n),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n]),
            block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
            state_slots=torch.tensor([0]),
            logits_indices=torch.tensor([n - 1]),
        )
        tokens.append(int(model(batch, cache)[0].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.slow
def test_greedy_engine_outputs_equal_the_plain_loop_batched_chunked_preempted(model):
    # the plain loop runs each prompt alone, so equality also means batched == alone
    prompts = _prompts(LENGTHS)
    n = len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seq_seed=1)] * n
    expected = {(str(i), 0): _plain_loop(model, p, 3) for i, p in enumerate(prompts)}
    together, _ = _generate(model, prompts, params)
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
    expected = {(str(i), 0): _plain_loop(model_v41, p, 3) for i, p in enumerate(prompts)}
    chunked, _ = _generate(model_v41, prompts, params, budget=50)
    assert chunked == expected
    preempted, num_preemptions = _generate(model_v41, prompts, params, num_blocks=3)
    assert num_preemptions > 0 and preempted == expected
