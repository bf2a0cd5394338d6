"""Under ``DEEPINFER_BATCH_INVARIANT=1`` the sampler's per-row results (token, its logprob,
the top-k alternatives, raw and processed; prompt logprobs) are bitwise the same for a row
alone and inside batches of 1, 7, 64 and 1,000 rows of random logits and random parameters
(greedy and sampled, penalties, bias, top-k / top-p / min-p, logprobs or not)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kernels.testing.invariance import positions_in_batch
from deepinfer.sampling import SamplingParams, prompt_logprobs, sample

VOCAB = 1000
SIZES = (1, 7, 64, 1000)
FIELDS = ("logprobs", "raw_logprobs")
TOP_FIELDS = ("top_logprobs", "top_token_ids", "raw_top_logprobs", "raw_top_token_ids")


@pytest.fixture(autouse=True)
def _invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.fixture(scope="module", autouse=True)
def _threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


def _params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else rng.uniform(0.3, 1.7),
        top_k=rng.choice([-1, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5)} if rng.random() < 0.3 else {},
        logprobs=rng.choice([None, 0, 3]),
        seed=rng.randrange(2**31),
    )


def _rows(n: int, seed: int):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=gen) * 3.0
    params = [_params(rng) for _ in range(n)]
    positions = [rng.randrange(1, 5000) for _ in range(n)]
    history = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))] for _ in range(n)]
    return logits, params, positions, history


def _row_result(result, i: int, width: int) -> dict[str, torch.Tensor]:
    out = {"token_ids": result.token_ids[i]}
    if result.logprobs is not None:
        out.update({f: getattr(result, f)[i] for f in FIELDS})
        out.update({f: getattr(result, f)[i, :width] for f in TOP_FIELDS})
    return out


def _compare(alone, batched, what):
    assert alone.keys() == batched.keys(), what
    for key, value in alone.items():
        assert torch.equal(value, batched[key]), f"{what}: {key} differs from the row alone"


@pytest.mark.parametrize("logprobs_everywhere", [False, True], ids=["mixed", "all-logprobs"])
def test_sample_row_alone_equals_row_in_batch(logprobs_everywhere):
    logits, params, positions, history = _rows(max(SIZES), seed=7)
    if logprobs_everywhere:  # every row on the logprob path, even greedy unprocessed ones
        params = [p if p.logprobs is not None else SamplingParams(
            temperature=p.temperature, seed=p.seed, logprobs=2) for p in params]  # fmt: skip
    alone = {}
    for n in SIZES:
        batched = sample(logits[:n], params[:n], positions[:n], output_token_ids=history[:n])
        for i in positions_in_batch(n):
            width = params[i].logprobs or 0
            if i not in alone:
                one = sample(logits[i : i + 1], params[i : i + 1], positions[i : i + 1],
                             output_token_ids=history[i : i + 1])  # fmt: skip
                alone[i] = _row_result(one, 0, width)
            got = _row_result(batched, i, width)
            if params[i].logprobs is None:  # the batch computes them for others only
                got = {"token_ids": got["token_ids"]}
            _compare(alone[i], got, f"row {i} of {n}")


def test_prompt_logprobs_row_alone_equals_row_in_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(max(SIZES), VOCAB, generator=gen) * 4.0
    targets = torch.randint(0, VOCAB, (max(SIZES),), generator=gen)
    for n in SIZES:
        batched = prompt_logprobs(logits[:n], targets[:n], 4)
        for i in positions_in_batch(n):
            one = prompt_logprobs(logits[i : i + 1], targets[i : i + 1], 4)
            for a, b in zip(one, batched, strict=True):
                assert torch.equal(a[0], b[i]), f"prompt logprobs: row {i} of {n}"
