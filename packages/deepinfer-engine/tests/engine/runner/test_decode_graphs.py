"""Decode graphs: the fixed-shape decode forward (what a graph captures) equals the eager one.

On CPU the fixed-shape forward runs eagerly (``DecodeGraphs(capture=False)``); every decode
step of a greedy generation is checked against the eager forward of the same step on a copy
of the cache: logits bitwise equal, and every cache tensor equal afterwards outside the
scratch slot 0 and the null block 0 (where padding rows write). Small context buckets make the
visible lists padded and make steps cross buckets; steps that complete different numbers of
compressed entries use different graphs; batches of 3 run on graphs of 4 token rows. The GPU
test captures and replays real graphs and compares greedy generations with
``enforce_eager=True`` token for token.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs, graph_batch_size
from deepinfer.engine.runner.decode_metadata import padded_count
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.sampling import SamplingParams

# (architecture, block size): V4's ratio-128 layers need 128-token blocks; "v4-hca8" is V4
# with a general HCA ratio (8).
CHECKPOINTS = [("v4", 128), ("v41", 16), ("v4-hca8", 16)]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: c[0])
def checkpoint(request, tmp_path_factory):
    kind, block_size = request.param
    directory = tmp_path_factory.mktemp(f"graphs-{kind}")
    if kind == "v41":
        config = tiny_v41_config(vision=False)
    else:
        config = tiny_v4_config(hca_ratio=8 if kind == "v4-hca8" else 128)
    make_random_checkpoint(directory, config, quantized=True, seed=0)
    return directory, block_size


class CheckedGraphs(DecodeGraphs):
    """Runs every step it takes both ways and asserts they agree; with ``warm`` a new key's
    warm-up (what a capture runs first) goes before the step."""

    checked = 0
    padded = 0  # steps that ran on a graph of more token rows
    warm = False

    def run(self, plan, rows, feed=None):
        key = self.key(plan, rows)
        if key is None:
            return None
        runner = self.runner
        before = _snapshot(self.cache)
        eager = runner.model(runner._batch(plan, rows), self.cache).clone()
        after_eager = _snapshot(self.cache)
        _restore(self.cache, before)
        if self.warm and key not in self.graphs:
            entry = self._new(key)
            self.load(entry, plan, feed)
            self.warm_up(entry)
        fixed = super().run(plan, rows, feed)
        assert torch.equal(fixed, eager), f"logits differ at {plan.num_tokens} tokens"
        for name, tensor in _snapshot(self.cache).items():
            real = _outside_scratch(self.cache, name)
            assert torch.equal(real(tensor), real(after_eager[name])), f"cache {name} differs"
        self.checked += 1
        self.padded += key[0] > plan.num_tokens
        return fixed


def _outside_scratch(cache, name: str):
    """The part of cache tensor ``name`` outside the null block 0 (arena tensors) or the scratch
    state slot 0 (per-slot tensors: slot 0's rows come first)."""
    lay = cache.layout
    if name in cache.tensors and cache.is_arena(name):
        return lambda t: t[t.shape[0] // lay.num_blocks :]
    return lambda t: t[t.shape[0] // lay.num_slots :]


def _snapshot(cache) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in {**cache.tensors, **cache.extra}.items()}


def _restore(cache, saved: dict[str, torch.Tensor]) -> None:
    for name, t in {**cache.tensors, **cache.extra}.items():
        t.copy_(saved[name])


def _prompts(count: int, seed: int, lengths: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = lengths or torch.randint(3, 30, (count,), generator=gen).tolist()
    return [torch.randint(20, 250, (n,), generator=gen).tolist() for n in lengths]


def _llm(checkpoint) -> LLM:
    directory, block_size = checkpoint
    return LLM(str(directory), dtype="float32", block_size=block_size, max_model_len=256,
               max_num_seqs=8, speculative_tokens=0)  # fmt: skip


def _checked(llm: LLM, warm: bool = False) -> CheckedGraphs:
    """:class:`CheckedGraphs` of up to 4 sequences, installed in ``llm``'s runner."""
    runner = llm._core.executor
    graphs = CheckedGraphs(runner.model, runner.cache, max_batch_size=4, max_context=256,
                           min_context=16, capture=False)  # fmt: skip
    graphs.runner, graphs.warm = runner, warm
    runner.graphs = graphs
    return graphs


def test_fixed_decode_forward_equals_eager(checkpoint, monkeypatch):
    """Padding rows change a step's row count, and torch's CPU matmul may pick its summation
    order from the row count (it does on some x86 machines), so bitwise equality with eager is
    the batch-invariant mode's promise: the test runs in it."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = _llm(checkpoint)
    graphs = _checked(llm)
    # 3 sequences (a graph of 4 rows), then 2, then 1 as they finish
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 5, 7)]
    outputs = llm.generate(prompt_token_ids=_prompts(3, 1, [27, 5, 12]), sampling_params=params,
                           use_tqdm=False)  # fmt: skip
    assert graphs.checked >= 6, "too few decode steps went through the fixed-shape forward"
    assert graphs.padded >= 3, "too few steps ran with padding rows"
    assert {key[0] for key in graphs.graphs} >= {4, 2, 1}
    assert len({key[1] for key in graphs.graphs}) >= 2, "no step crossed a context bucket"
    emits = {key[2] for key in graphs.graphs}
    assert len(emits) >= 2, f"one entry count only: {emits}"
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 5, 7]


def test_graph_batch_sizes_and_entry_rows():
    sizes = [graph_batch_size(t, 256) for t in range(1, 257)]
    assert sizes[:9] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert sizes[56:65] == [64] * 8 + [72] and sizes[-1] == 256
    assert all(t <= size for t, size in enumerate(sizes, 1))
    assert len(set(sizes)) == 35  # 1, 2, 4 and the multiples of 8
    assert graph_batch_size(5, 6) == 6 and graph_batch_size(3, 3) == 3
    assert [padded_count(e, 64) for e in (0, 1, 2, 3, 5, 17, 33, 64)] == [0, 1, 2, 4, 8, 32, 64, 64]
    assert padded_count(5, 6) == 6


def test_warm_up_leaves_the_step_unchanged(checkpoint, monkeypatch):
    """V4.1's Engram history ring is read then written by the forward: a warm-up that left its
    writes behind changed the first replay of every new graph (fails without the restore).
    Batch-invariant mode, as above: the padded step must equal eager bit for bit."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = _llm(checkpoint)
    graphs = _checked(llm, warm=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompt_token_ids=_prompts(2, 3, [7, 11]), sampling_params=params,
                 use_tqdm=False)  # fmt: skip
    assert graphs.checked >= 4 and len(graphs.graphs) >= 2


def test_ineligible_steps_run_eagerly(checkpoint):
    llm = _llm(checkpoint)
    runner = llm._core.executor
    graphs = DecodeGraphs(runner.model, runner.cache, max_batch_size=2, max_context=256,
                          capture=False)  # fmt: skip
    prompts = _prompts(3, 2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eager = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    runner.graphs = graphs
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in eager]
    assert not graphs.graphs, "a 3-sequence decode step used a graph of at most 2"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager_on_gpu(checkpoint):
    directory, block_size = checkpoint
    blocks = 8 * (512 // block_size) + 8  # a fixed cache: both engines fit on one GPU
    kwargs = dict(block_size=block_size, max_model_len=512, max_num_seqs=8,
                  num_cache_blocks=blocks, speculative_tokens=0)  # fmt: skip
    graphs_on = LLM(str(directory), **kwargs)
    graphs = graphs_on._core.executor.graphs
    assert graphs is not None
    graphs.max_batch_size = 6  # steps of 7 or 8 sequences miss the graphs and run eagerly
    graphs.min_context = 32  # small buckets: generations cross them
    eager = LLM(str(directory), enforce_eager=True, **kwargs)
    assert eager._core.executor.graphs is None

    def both(prompts, params):
        want = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got = graphs_on.generate(prompt_token_ids=prompts, sampling_params=params,
                                 use_tqdm=False)  # fmt: skip
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for count in (1, 6, 8):
        both(_prompts(count, count), params)
    replays = graphs.num_replays
    assert replays >= 40, f"only {replays} graph replays"
    # 12 requests of different lengths, 8 at a time: prefills of the waiting ones join the
    # decode steps of the others as they finish; the batch shrinks through 6 and below
    varied = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(12)]  # fmt: skip
    both(_prompts(12, 7), varied)
    assert graphs.num_replays > replays and not graphs.failed
