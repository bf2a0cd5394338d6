"""Sampled requests with speculation: seed-exact mode reproduces a run without speculation for
every seed; rejection mode keeps the target's distribution (chi-square goodness of fit against
the exactly computed distribution of the first two tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.runner.drafting import DraftRequest, Proposal
from deepinfer.engine.runner.spec_sampling import processed_probs
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.sampling import SamplingParams, rng
from deepinfer.spec import draw_categorical
from deepinfer.spec.testing import chi_square_p_value

K = 3
SIGNIFICANCE = 1e-3  # false-alarm rate of the goodness-of-fit test (runs are deterministic)


def _engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), dtype="float32", block_size=16, max_model_len=160, **kwargs)


def test_seed_exact_tokens_equal_a_run_without_speculation(dspark_checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    gen = random.Random(1)
    prompts = [[gen.randrange(20, 250) for _ in range(gen.randrange(3, 20))] for _ in range(8)]
    params = [
        SamplingParams(temperature=t, top_p=p, max_tokens=10, ignore_eos=True, seed=seed)
        for seed, (t, p) in zip(range(8), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.8), (1.0, 0.5)] * 2)
    ]
    plain = _engine(dspark_checkpoint, speculative_tokens=0)
    spec = _engine(dspark_checkpoint, speculative_tokens=K, spec_acceptance="auto")
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0


@dataclass
class SoftOracle:
    """Drafts one token after the anchor ``t1`` from ``q = (p(. | t1) + u) / 2`` (``u``
    uniform over four tokens), drawn on the draft stream and kept for rejection sampling."""

    target_given_first: dict[int, torch.Tensor]
    num_draft_tokens: int = K

    def seed(self, step, batch) -> None:
        pass

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            p = self.target_given_first[r.anchor]
            uniform = torch.zeros_like(p)
            uniform[torch.tensor([3, 50, 100, int(p.argmax())])] = 0.25
            q = (p + uniform) / 2
            seed = torch.tensor([r.params.seq_seed])
            draft = draw_categorical(
                q[None], seed, torch.tensor([r.last_position + 2]), rng.STREAM_DRAFT
            )
            out[r.request_id] = Proposal([int(draft)], [0.5], q[None])
        return out


def _processed(model, tokens: list[int], params, history: list[int]) -> torch.Tensor:
    logits = SimpleRunner(model, max_seqs=1, max_len=len(tokens)).step({0: tokens})[0][-1:]
    return processed_probs(logits, [params], [history])[0]


PROMPT = [40, 41, 42, 43, 44, 45]
PARAMS = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
NUM_REQUESTS = 2000


def _exact(model) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The processed target distribution of token 1, and of token 2 given each token 1."""
    first = _processed(model, PROMPT, PARAMS, [])
    support = first.nonzero()[:, 0].tolist()
    return first, {t: _processed(model, PROMPT + [t], PARAMS, [t]) for t in support}


def _joint(first: torch.Tensor, given: dict[int, torch.Tensor]) -> torch.Tensor:
    joint = torch.zeros(first.shape[0], first.shape[0])
    for t, p in given.items():
        joint[t] = first[t] * p
    return joint


def test_rejection_sampling_keeps_the_target_distribution(dspark_checkpoint):
    llm = _engine(dspark_checkpoint, speculative_tokens=K, max_num_seqs=256, seed=7)
    runner = llm._core.executor
    first, given = _exact(runner.model)
    runner.drafter = SoftOracle(given)
    outputs = llm.generate(
        prompt_token_ids=[PROMPT] * NUM_REQUESTS, sampling_params=PARAMS, use_tqdm=False
    )  # no seeds: rejection sampling under spec_acceptance="auto"
    counts = torch.zeros(first.shape[0], first.shape[0])
    for o in outputs:
        t1, t2 = o.outputs[0].token_ids[:2]
        counts[t1, t2] += 1
    p_value = chi_square_p_value(counts, _joint(first, given))
    assert p_value > SIGNIFICANCE, f"tokens do not follow the target distribution (p={p_value})"
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    assert drafted == NUM_REQUESTS and 0 < accepted < drafted, (accepted, drafted)


def test_rejection_distribution_test_detects_a_biased_sampler(dspark_checkpoint):
    """Negative control: the same test rejects counts drawn with 5% of the mass of the
    likeliest pair moved to the least likely possible pair."""
    model = _engine(dspark_checkpoint, speculative_tokens=0)._core.executor.model
    joint = _joint(*_exact(model)).reshape(-1)
    biased = joint.clone()
    possible = joint.nonzero()[:, 0]
    likeliest, rarest = int(joint.argmax()), int(possible[joint[possible].argmin()])
    shift = min(0.05, float(joint[likeliest]))
    biased[likeliest] -= shift
    biased[rarest] += shift
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(biased, NUM_REQUESTS, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=joint.numel()).float()
    assert chi_square_p_value(counts, joint) < SIGNIFICANCE
