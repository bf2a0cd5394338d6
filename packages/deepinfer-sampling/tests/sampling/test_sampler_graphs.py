"""The sampler's CUDA graphs: the capture policy (CPU), and on the GPU, graphed draws equal the
eager ones bit for bit while the inputs behind the captured addresses change."""

import pytest
import torch

from deepinfer.sampling import SamplingParams, graphs, sample
from deepinfer.sampling.graphs import GraphPolicy

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_policy_captures_on_the_second_sighting_and_then_replays():
    policy = GraphPolicy(max_graphs=2, max_captures=3)
    assert policy.decide("a") == "eager"
    assert policy.decide("b") == "eager"
    assert policy.decide("a") == "capture"
    policy.store("a", object())
    assert policy.decide("a") == "replay"
    assert policy.decide("b") == "capture"
    policy.store("b", object())
    assert [policy.decide(k) for k in ("c", "c")] == ["eager", "capture"]
    policy.store("c", object())  # evicts the least recently used: "a"
    assert set(policy.captured) == {"b", "c"}
    assert policy.decide("a") == "eager"  # seen again from scratch
    assert policy.decide("a") == "eager"  # the capture budget (3) is spent
    assert policy.decide("b") == "replay"


def test_disabled_policy_only_replays_what_it_has():
    policy = GraphPolicy()
    policy.decide("a")
    assert policy.decide("a") == "capture"
    policy.store("a", object())
    policy.disabled = True
    assert policy.decide("a") == "replay"
    assert [policy.decide("b") for _ in range(3)] == ["eager"] * 3


def _params(rows, step, greedy_every=0):
    out = []
    for i in range(rows):
        greedy = greedy_every and i % greedy_every == 0
        out.append(SamplingParams(
            temperature=0.0 if greedy else 0.6 + 0.1 * (i % 5), top_k=[0, 20, 200][i % 3],
            top_p=[1.0, 0.9, 0.7][(i + step) % 3], min_p=0.02 * (i % 2), seq_seed=1000 * step + i,
        ))  # fmt: skip
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("greedy_every", [0, 4])
@pytest.mark.parametrize("positions_on_device", [False, True])
def test_graphed_draws_equal_eager_draws_as_inputs_change(
    monkeypatch, greedy_every, positions_on_device
):
    graphs.reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, vocab = 48, 129280
    logits = torch.empty(rows, vocab, device="cuda")
    results = []
    for step in range(5):
        logits.normal_(generator=gen).mul_(3.0)  # new values at the captured address
        params = _params(rows, step, greedy_every)
        positions = list(range(step, step + rows))
        given = torch.tensor(positions, device="cuda") if positions_on_device else positions
        graphed = sample(logits, params, given).token_ids
        monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
        eager = sample(logits, params, given).token_ids
        monkeypatch.delenv("DEEPINFER_ENFORCE_EAGER")
        assert torch.equal(graphed, eager), step
        results.append(graphed)
    assert len(graphs._policy.captured) == 1  # captured on step 1, replayed on steps 2-4
    assert len({tuple(r.tolist()) for r in results}) == 5  # the inputs changed every step
    # each result is the caller's own tensor: later replays did not overwrite it
    last = results[-1].clone()  # a replay's result
    sample(logits, _params(rows, 9, greedy_every), given)
    assert torch.equal(results[-1], last)


@pytest.mark.gpu
@needs_gpu
def test_each_logits_address_gets_its_own_graph(monkeypatch):
    graphs.reset()
    params = _params(16, 0)
    positions = list(range(16))
    a = torch.randn(16, 4096, device="cuda") * 3
    b = torch.randn(16, 4096, device="cuda") * 3
    got_a = [sample(a, params, positions).token_ids for _ in range(3)]  # eager, capture, replay
    got_b = [sample(b, params, positions).token_ids for _ in range(3)]
    assert len(graphs._policy.captured) == 2
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    want_a, want_b = sample(a, params, positions).token_ids, sample(b, params, positions).token_ids
    assert not torch.equal(want_a, want_b)
    assert all(torch.equal(t, want_a) for t in got_a)
    assert all(torch.equal(t, want_b) for t in got_b)
