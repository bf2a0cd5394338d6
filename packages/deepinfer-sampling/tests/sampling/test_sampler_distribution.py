"""Empirical frequencies of 50k seeded draws match the exact processed distribution (TV < 0.01).

Each test samples 50,000 rows with the same logits and distinct seeds in one batched call, and
compares the histogram with the distribution computed here from the definitions, in float64.
"""

import zlib

import pytest
import torch

from deepinfer.sampling import SamplingParams, sample

NUM_DRAWS = 50_000
VOCAB = 10
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


def _logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=gen, dtype=torch.float64) * 1.5


def _expected(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The processed distribution from its definition (brute force over tokens)."""
    s = logits / temperature
    greater = (s[None, :] > s[:, None]).sum(1)
    keep = greater < (top_k if top_k > 0 else VOCAB)
    p = torch.exp(s - s.max()) * keep
    if top_p < 1.0:
        above = (torch.where(s[None, :] > s[:, None], p[None, :], 0.0)).sum(1)
        keep &= above < top_p * p.sum()
    keep &= torch.exp(s - s.max()) >= min_p
    probs = torch.where(keep, torch.exp(s - s.max()), 0.0)
    return probs / probs.sum()


def _empirical(logits, params_kwargs, output_token_ids=None, device="cpu"):
    batch = logits.float().expand(NUM_DRAWS, VOCAB).to(device)
    params = [SamplingParams(seq_seed=1000 + i, **params_kwargs) for i in range(NUM_DRAWS)]
    positions = [17] * NUM_DRAWS
    outputs = None if output_token_ids is None else [output_token_ids] * NUM_DRAWS
    tokens = sample(batch, params, positions, output_token_ids=outputs).token_ids.cpu()
    return torch.bincount(tokens, minlength=VOCAB).double() / NUM_DRAWS


def _tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.5},
        {"top_k": 3},
        {"top_p": 0.7},
        {"top_p": 0.9, "temperature": 0.8},
        {"min_p": 0.2},
        {"top_k": 5, "top_p": 0.8, "min_p": 0.05, "temperature": 1.3},
    ],
    ids=str,
)
@pytest.mark.parametrize("device", DEVICES)
def test_filters_match_exact_distribution(kwargs, device):
    logits = _logits(zlib.crc32(str(sorted(kwargs.items())).encode()))
    want = _expected(logits, **kwargs)
    got = _empirical(logits, kwargs, device=device)
    assert (got[want == 0] == 0).all(), "a filtered-out token was drawn"
    assert _tv(got, want) < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_exact_distribution(device):
    logits = _logits(3)
    history = [1, 1, 4, 7, 7, 7]
    kwargs = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}
    penalised = logits.clone()
    for token in set(history):
        count = history.count(token)
        value = penalised[token]
        value = value / 1.3 if value > 0 else value * 1.3
        penalised[token] = value - 0.4 * count - 0.3
    want = torch.softmax(penalised, 0)
    got = _empirical(logits, kwargs, output_token_ids=history, device=device)
    assert _tv(got, want) < 0.01
    assert _tv(got, torch.softmax(logits, 0)) > 0.05  # the penalties did change the distribution
