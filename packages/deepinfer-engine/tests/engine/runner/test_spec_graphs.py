"""Speculative steps on fixed-shape graphs equal the eager speculative loop, bit for bit in
batch-invariant mode: verification steps (1 + k_i tokens per request, ragged under confidence
scheduling, padded to a capture size) with the drafter seeded inside the step, and the DSpark
stages of every proposal on a padded block of requests.

On CPU the fixed-shape forwards run eagerly (``capture=False``), installed in the runner as
the loader installs the captured ones on CUDA unless ``DEEPINFER_SPEC_GRAPHS=0``; the GPU test
captures and replays real graphs through that switch. GPU command:

    python -m pytest packages/deepinfer-engine/tests/engine/runner/test_spec_graphs.py -q -m gpu
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.cost_profile import profile_sizes
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.runner.draft_graphs import DraftGraphs
from deepinfer.sampling import SamplingParams
from deepinfer.spec import StepCostCurve

EMBEDDED = Path(__file__).resolve().parents[5] / "examples" / "tiny_model" / "checkpoint"
NUM_PROMPTS = 12
# a row costs 1/8 of a step: confidence scheduling verifies ragged numbers of drafts
CURVE = StepCostCurve.from_points([(1, 8.0), (400, 407.0)])


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


class CountedGraphs(DecodeGraphs):
    """Counts the verification steps that ran on the fixed-shape forward."""

    verified = 0

    def run(self, plan, rows, feed=None):
        logits = super().run(plan, rows, feed)
        self.verified += logits is not None and any(plan.num_drafts)
        return logits


class CountedDraftGraphs(DraftGraphs):
    """Counts the proposals that ran on the fixed-shape forward, per kind (greedy picks in it
    or not)."""

    proposals = {False: 0, True: 0}
    chained = 0  # proposals whose anchors came from the verification step on the device

    def run(self, anchors, last_positions, slots, greedy=False):
        return self._count(super().run(anchors, last_positions, slots, greedy), greedy)

    def run_on_device(self, anchors, last_positions, slots, greedy=False):
        self.chained += 1
        return self._count(super().run_on_device(anchors, last_positions, slots, greedy), greedy)

    def _count(self, block, greedy):
        self.proposals = {**self.proposals, greedy: self.proposals[greedy] + (block is not None)}
        return block


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(20, 250) for _ in range(rng.randrange(3, 12))] for _ in range(12)]


def _params(longest: int = 8) -> list[SamplingParams]:
    """Seeded requests with logprobs and plain greedy ones, finishing at different steps; the
    seeded ones first, so that later proposals are all plain greedy (their picks in the graph)."""
    return [
        SamplingParams(temperature=0, max_tokens=longest - i // 4, ignore_eos=True)
        if i % 2 else
        SamplingParams(temperature=0.8, seed=10 + i, max_tokens=longest // 2 - i // 8,
                       ignore_eos=True, logprobs=1)
        for i in range(NUM_PROMPTS)
    ]  # fmt: skip


def _engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), dtype="float32", block_size=16, max_model_len=128,
               max_num_seqs=NUM_PROMPTS, speculative_tokens=3, spec_varlen=True,
               spec_cost_curve=CURVE, return_draft_confidences=True, **kwargs)  # fmt: skip


def _install_fixed_shape(llm: LLM) -> tuple[CountedGraphs, CountedDraftGraphs]:
    """What ``DEEPINFER_SPEC_GRAPHS=1`` builds on CUDA, running eagerly (``capture=False``)."""
    runner = llm._core.executor
    k = runner.drafter.num_draft_tokens
    graphs = CountedGraphs(runner.model, runner.cache, max_batch_size=NUM_PROMPTS * (1 + k),
                           max_context=128, min_context=16, capture=False,
                           speculative=True)  # fmt: skip
    drafts = CountedDraftGraphs(runner.model, runner.cache, k, max_requests=NUM_PROMPTS,
                                capture=False)  # fmt: skip
    runner.graphs, runner.drafter.graphs = graphs, drafts
    return graphs, drafts


def _records(outputs):
    """Tokens and logprobs, and what the drafter did: speculation is exact whatever the drafts,
    so only the accept counts and confidences show a drafter that went wrong."""
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.num_draft_tokens,
         o.metrics.num_accepted_tokens, o.metrics.draft_confidences)
        for o in outputs
    ]  # fmt: skip


@pytest.mark.parametrize("checkpoint", ["dspark", "embedded"])
def test_spec_graphs_equal_the_eager_speculative_loop(checkpoint, dspark_checkpoint):
    directory = dspark_checkpoint if checkpoint == "dspark" else EMBEDDED
    prompts, params = _prompts(), _params()
    eager = _engine(directory).generate(prompt_token_ids=prompts, sampling_params=params,
                                        use_tqdm=False)  # fmt: skip
    llm = _engine(directory)
    graphs, drafts = _install_fixed_shape(llm)
    fixed = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _records(fixed) == _records(eager)
    assert [len(o.outputs[0].token_ids) for o in fixed] == [p.max_tokens for p in params]
    lengths = {len(step) for o in fixed for step in o.metrics.draft_confidences}
    assert len(lengths) > 2, f"drafts were not ragged: {lengths}"
    assert graphs.verified >= 3, "too few verification steps ran on the fixed-shape forward"
    assert min(drafts.proposals.values()) >= 2, f"too few draft graph runs: {drafts.proposals}"
    assert len({key[0] for key in graphs.graphs}) >= 2 and len(drafts.graphs) >= 3
    if checkpoint == "embedded":  # a trained drafter: accepted drafts move the sequences on
        assert sum(o.metrics.num_accepted_tokens for o in fixed) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_steps_draft_from_the_device(async_scheduling):
    """Plain greedy batches verify and draft as one queue of device work, the next drafts'
    anchors taken from the verification on the device and read back with the drafts: tokens,
    accept counts and confidences equal the eager loop's (which reads the verification back
    before drafting), through accepted drafts, a batch that shrinks as requests finish and
    the steps near ``max_tokens`` that propose from the host."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * (i % 5), ignore_eos=True)
              for i in range(NUM_PROMPTS)]  # fmt: skip
    eager = _engine(EMBEDDED, async_scheduling=async_scheduling)
    want = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm = _engine(EMBEDDED, async_scheduling=async_scheduling)
    graphs, drafts = _install_fixed_shape(llm)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _records(got) == _records(want)
    assert drafts.chained >= 5, f"too few proposals drafted from the device: {drafts.chained}"
    assert drafts.chained < drafts.proposals[True], "every proposal drafted from the device"
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_spec_graphs_replay_on_the_gpu(monkeypatch, async_scheduling):
    """The embedded model with real captures: outputs equal the switch off, graphs replayed,
    and no replayed step synchronises with the host (``DEEPINFER_SYNC_GUARD=1``)."""
    prompts, params = _prompts(), _params(longest=64)

    def run(switch: str):
        monkeypatch.setenv("DEEPINFER_SPEC_GRAPHS", switch)
        llm = LLM(str(EMBEDDED), accelerator="nvidia", max_model_len=256,
                  gpu_memory_utilization=0.3, max_num_seqs=NUM_PROMPTS, spec_varlen=True,
                  spec_cost_curve=CURVE, async_scheduling=async_scheduling)  # fmt: skip
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return _records(out), llm._core.executor

    off, runner = run("0")
    assert runner.graphs is None, "graphs for speculative steps with the switch off"
    monkeypatch.setenv("DEEPINFER_SYNC_GUARD", "1")
    on, runner = run("1")
    assert runner.graphs is not None and runner.graphs.speculative
    assert runner.graphs.num_replays > 10, "verification graphs were not replayed"
    assert runner.drafter.graphs.num_replays > 10, "draft graphs were not replayed"
    assert [r[:2] for r in on] == [r[:2] for r in off], "tokens or logprobs differ"
    assert on == off, "accept counts or draft confidences differ: the drafter's graphs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_planner_curve_is_measured_on_the_step_graphs(monkeypatch, tmp_path):
    """Confidence scheduling without a given curve measures it at load by replaying the
    verification graphs (each size captured, then replayed: warm), stores it, and the dummy
    steps it ran on the engine's own cache change no output: an engine given the same curve
    (nothing measured) emits the same tokens, logprobs, accept counts and confidences."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    settings = dict(accelerator="nvidia", max_model_len=256, gpu_memory_utilization=0.3,
                    max_num_seqs=NUM_PROMPTS, spec_varlen=True,
                    return_draft_confidences=True)  # fmt: skip
    measured = LLM(str(EMBEDDED), spec_cost_curve="remeasure", **settings)
    runner = measured._core.executor
    curve, k = runner.spec.cost_curve, runner.spec.num_draft_tokens
    sizes = profile_sizes(NUM_PROMPTS * (k + 1))
    assert curve.num_tokens == tuple(sizes) and len(list((tmp_path / "cost_curves").iterdir()))
    # two warm-up runs (the first captures) and five timed runs per size, all replays
    assert runner.graphs.num_replays >= 7 * len(sizes), runner.graphs.num_replays
    prompts, params = _prompts(), _params(longest=48)
    got = measured.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    given = LLM(str(EMBEDDED), spec_cost_curve=curve, **settings)
    want = given.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _records(got) == _records(want)
