"""Verification planning: optimality against brute force, prefix property, cost curve."""

import itertools

import pytest
import torch

from deepinfer.spec import (
    StepCostCurve,
    plan_verification,
    plan_verify_counts,
    split_verify_slots,
    survival_probabilities,
)


def _random_curve(generator, max_tokens):
    """A rising, convex-then-linear-ish measured curve with a few random points."""
    sizes = sorted(
        {1, max_tokens, *torch.randint(2, max_tokens, (3,), generator=generator).tolist()}
    )
    base = float(torch.rand(1, generator=generator)) + 0.5
    slope = float(torch.rand(1, generator=generator)) * 0.3
    costs = [base + slope * n + float(torch.rand(1, generator=generator)) * 0.05 for n in sizes]
    costs = [max(costs[: i + 1]) for i in range(len(costs))]  # measured curves are monotone
    return StepCostCurve(tuple(sizes), tuple(costs))


def _brute_force(confidences, counts, curve, num_other, fixed_cost):
    """Best objective over every per-request prefix length (exhaustive)."""
    survival = survival_probabilities(confidences, counts).double()
    batch = confidences.shape[0]
    best = -1.0
    for lengths in itertools.product(*(range(int(c) + 1) for c in counts)):
        gain = sum(float(survival[b, :length].sum()) for b, length in enumerate(lengths))
        tokens = num_other + batch + sum(lengths)
        best = max(best, (batch + gain) / (curve(tokens) + fixed_cost))
    return best


@pytest.mark.parametrize("instance", range(40))
def test_plan_is_optimal_on_small_random_instances(instance):
    generator = torch.Generator().manual_seed(100 + instance)
    batch = int(torch.randint(1, 4, (1,), generator=generator))
    max_drafts = int(torch.randint(1, 5, (1,), generator=generator))
    confidences = torch.rand(batch, max_drafts, generator=generator)
    if instance % 4 == 0:  # exact ties and certain drafts
        confidences = (confidences * 4).round() / 4
    counts = torch.randint(0, max_drafts + 1, (batch,), generator=generator)
    curve = _random_curve(generator, 16)
    num_other = int(torch.randint(0, 4, (1,), generator=generator))
    fixed_cost = float(torch.rand(1, generator=generator))
    plan = plan_verification(
        confidences, counts, curve, num_other_tokens=num_other, fixed_cost=fixed_cost
    )
    best = _brute_force(confidences, counts, curve, num_other, fixed_cost)
    assert plan.tokens_per_cost == pytest.approx(best, rel=1e-9)
    # The plan's bookkeeping is consistent with its own split.
    survival = survival_probabilities(confidences, counts).double()
    lengths = plan.num_verify_drafts
    assert (lengths <= counts).all() and (lengths >= 0).all()
    assert plan.num_step_tokens == num_other + batch + int(lengths.sum())
    gain = sum(float(survival[b, : int(n)].sum()) for b, n in enumerate(lengths))
    assert plan.expected_tokens == pytest.approx(batch + gain, rel=1e-9)
    assert plan.cost == pytest.approx(curve(plan.num_step_tokens) + fixed_cost)


def _tensor_plan(confidences, counts, curve, num_other):
    """The plan in tensor ops: float32 survivals, their float64 cumulative sum best first,
    the first maximum of the objective, split by :func:`split_verify_slots`."""
    survival = survival_probabilities(confidences, counts)
    live = torch.arange(confidences.shape[1])[None, :] < counts[:, None]
    gains = torch.sort(survival[live], descending=True, stable=True).values.double()
    expected = confidences.shape[0] + torch.cat([torch.zeros(1, dtype=torch.float64),
                                                 gains.cumsum(0)])  # fmt: skip
    base = num_other + confidences.shape[0]
    costs = torch.tensor([curve(base + m) for m in range(len(expected))], dtype=torch.float64)
    m = int(torch.argmax(expected / costs))
    lengths = split_verify_slots(confidences, counts, m).tolist()
    return lengths, base + m, float(expected[m]), float(costs[m])


@pytest.mark.parametrize("instance", range(30))
def test_host_plan_is_the_tensor_plan_bit_for_bit(instance):
    generator = torch.Generator().manual_seed(300 + instance)
    batch, max_drafts = 1 + 7 * instance, 1 + instance % 6
    confidences = torch.rand(batch, max_drafts, generator=generator)
    if instance % 3 == 0:  # exact ties, certain and impossible drafts
        confidences = (confidences * 4).round() / 4
    counts = torch.randint(0, max_drafts + 1, (batch,), generator=generator)
    curve = _random_curve(generator, 8 * batch)
    num_other = instance % 4
    want = _tensor_plan(confidences, counts, curve, num_other)
    ragged = [row[:n] for row, n in zip(confidences.tolist(), counts.tolist())]
    plan = plan_verify_counts(ragged, counts.tolist(), curve, num_other_tokens=num_other)
    got = (plan.num_verify_drafts, plan.num_step_tokens, plan.expected_tokens, plan.cost)
    assert got == want
    tensor = plan_verification(confidences, counts, curve, num_other_tokens=num_other)
    assert tensor.num_verify_drafts.tolist() == want[0] and tensor.cost == want[3]


def test_host_plan_breaks_ties_by_request():
    # equal survivals at each position; a step of 4 + 6 tokens costs as much as one of 4
    stairs = StepCostCurve((10, 11), (1.0, 2.0), staircase=True)
    plan = plan_verify_counts([[0.75] * 3] * 4, [3] * 4, stairs)
    assert plan.num_verify_drafts == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="confidences"):
        plan_verify_counts([[0.5, float("nan")]], [2], stairs)


def test_split_takes_the_highest_survival_pairs_as_prefixes():
    generator = torch.Generator().manual_seed(5)
    confidences = torch.rand(16, 6, generator=generator)
    confidences[3] = 1.0  # ties along a request must still give a prefix
    confidences[4, 2] = 0.0
    counts = torch.randint(0, 7, (16,), generator=generator)
    survival = survival_probabilities(confidences, counts)
    live = survival[torch.arange(6)[None, :] < counts[:, None]]
    for num_slots in [0, 1, 7, 20, int(counts.sum()), int(counts.sum()) + 5]:
        lengths = split_verify_slots(confidences, counts, num_slots)
        assert int(lengths.sum()) == min(num_slots, int(counts.sum()))
        assert (lengths <= counts).all()
        chosen = torch.arange(6)[None, :] < lengths[:, None]
        if 0 < int(lengths.sum()) < live.numel():
            # Every chosen pair is at least as likely as every pair left out.
            left_out = (torch.arange(6)[None, :] < counts[:, None]) & ~chosen
            assert float(survival[chosen].min()) >= float(survival[left_out].max())
        tensor_slots = split_verify_slots(confidences, counts, torch.tensor(num_slots))
        assert torch.equal(tensor_slots, lengths)


def test_flat_cost_verifies_everything_and_steep_cost_verifies_nothing():
    generator = torch.Generator().manual_seed(6)
    confidences = torch.rand(4, 5, generator=generator) * 0.9 + 0.05
    counts = torch.tensor([5, 3, 0, 5])
    flat = StepCostCurve((1, 64), (1.0, 1.0))
    assert plan_verification(confidences, counts, flat).num_verify_drafts.tolist() == [5, 3, 0, 5]
    steep = StepCostCurve((1, 2), (1.0, 2.0))  # every extra token costs a full request's step
    assert plan_verification(confidences, counts, steep).num_verify_drafts.tolist() == [0] * 4


def test_fixed_cost_and_token_cap_change_the_plan():
    generator = torch.Generator().manual_seed(7)
    confidences = torch.rand(8, 5, generator=generator)
    counts = torch.full((8,), 5)
    curve = StepCostCurve((1, 8, 48), (1.0, 1.2, 6.0))
    lean = plan_verification(confidences, counts, curve)
    heavy = plan_verification(confidences, counts, curve, fixed_cost=5.0)
    # A large per-step overhead makes extra verify tokens relatively cheaper.
    assert heavy.num_step_tokens >= lean.num_step_tokens
    capped = plan_verification(confidences, counts, curve, fixed_cost=5.0, max_num_step_tokens=12)
    assert capped.num_step_tokens <= 12
    with pytest.raises(ValueError, match="max_num_step_tokens"):
        plan_verification(confidences, counts, curve, max_num_step_tokens=7)


def test_plan_is_deterministic_and_rejects_bad_confidences():
    generator = torch.Generator().manual_seed(8)
    confidences = torch.rand(6, 5, generator=generator)
    counts = torch.randint(0, 6, (6,), generator=generator)
    curve = StepCostCurve((1, 4, 16, 64), (1.0, 1.05, 1.4, 3.0), staircase=True)
    first = plan_verification(confidences, counts, curve)
    second = plan_verification(confidences.clone(), counts.clone(), curve)
    assert torch.equal(first.num_verify_drafts, second.num_verify_drafts)
    bad = confidences.clone()
    bad[0, 0] = 1.5
    with pytest.raises(ValueError, match="confidences"):
        plan_verification(bad, counts, curve)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="confidences"):
        plan_verification(bad, counts, curve)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        plan_verification(confidences, torch.full((6,), 9), curve)


def test_cost_curve_interpolates_clamps_and_extrapolates():
    curve = StepCostCurve.from_points([(16, 3.0), (1, 1.0), (4, 1.5)])
    assert curve.num_tokens == (1, 4, 16)
    assert curve(1) == pytest.approx(1.0)
    assert curve(2) == pytest.approx(1.0 + 0.5 / 3)
    assert curve(10) == pytest.approx(1.5 + 1.5 * 6 / 12)
    assert curve(32) == pytest.approx(3.0 + 1.5 / 12 * 16)  # last segment's slope
    stairs = StepCostCurve((1, 4, 16), (1.0, 1.5, 3.0), staircase=True)
    assert [stairs(n) for n in (1, 2, 4, 5, 16)] == pytest.approx([1.0, 1.5, 1.5, 3.0, 3.0])
    assert StepCostCurve((8,), (2.0,))(100) == pytest.approx(2.0)
    many = torch.tensor([1, 3, 9, 40])
    assert curve.costs(many).tolist() == pytest.approx([curve(int(n)) for n in many])
    for c in (curve, stairs, StepCostCurve((8,), (2.0,))):  # walked in order: one call's floats
        assert c.cost_range(0, 40) == [c(n) for n in range(40)]


@pytest.mark.parametrize(
    ("num_tokens", "cost", "message"),
    [
        ((), (), "same positive number"),
        ((1, 2), (1.0,), "same positive number"),
        ((2, 2), (1.0, 1.0), "strictly increasing"),
        ((0, 2), (1.0, 1.0), "positive ints"),
        ((1, 2), (1.0, -1.0), "finite positive"),
    ],
)
def test_cost_curve_validation(num_tokens, cost, message):
    with pytest.raises(ValueError, match=message):
        StepCostCurve(num_tokens, cost)


def test_cost_curve_from_noisy_samples_is_median_and_monotone():
    generator = torch.Generator().manual_seed(9)
    true_cost = {1: 2.0, 8: 2.2, 16: 2.1, 64: 4.0}  # a dip at 16, as noisy timings show
    samples = {
        n: (cost + 0.01 * torch.randn(7, generator=generator)).tolist()
        for n, cost in true_cost.items()
    }
    samples[64].append(100.0)  # one outlier does not move the median
    curve = StepCostCurve.from_samples(samples)
    assert curve.num_tokens == (1, 8, 16, 64)
    assert curve.cost[0] == pytest.approx(2.0, abs=0.02)
    assert curve.cost[3] == pytest.approx(4.0, abs=0.02)
    assert all(b >= a for a, b in zip(curve.cost, curve.cost[1:]))
    assert curve.cost[2] == curve.cost[1]
    with pytest.raises(ValueError, match=r"num_tokens=\[8\]"):
        StepCostCurve.from_samples({1: [1.0], 8: []})


def test_device_side_split_treats_nan_and_out_of_range_confidences_safely():
    confidences = torch.tensor([[0.9, float("nan"), 0.8], [1.7, 0.6, -0.2]])
    counts = torch.tensor([3, 3])
    survival = survival_probabilities(confidences, counts)
    assert torch.allclose(survival, torch.tensor([[0.9, 0.0, 0.0], [1.0, 0.6, 0.0]]))
    assert split_verify_slots(confidences, counts, 3).tolist() == [1, 2]
