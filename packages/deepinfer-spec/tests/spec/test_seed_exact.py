"""Greedy and seed-exact speculation reproduce non-speculative decoding token for token,
with fixed and with confidence-scheduled (variable) verification lengths."""

import pytest
import torch

from deepinfer.sampling import rng
from deepinfer.spec import StepCostCurve
from deepinfer.spec.testing import blend, generate_plain, generate_speculative, random_transition

VOCAB = 16
ROWS = 256
LENGTH = 16
# Rising cost: verifying every draft of every row is not worth it, so plans vary per step.
CURVE = StepCostCurve((1, 256, 512, 2048), (1.0, 1.1, 1.3, 6.0))


def _chains(seed):
    generator = torch.Generator().manual_seed(seed)
    target = random_transition(VOCAB, generator, sharpness=2.5)
    draft = blend(target, random_transition(VOCAB, generator, sharpness=2.5), 0.7)
    return generator, target, draft


def _requests(generator, max_drafts):
    first = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    seeds = torch.randint(0, 2**62, (ROWS,), generator=generator)
    positions = torch.randint(0, 1 << 20, (ROWS,), generator=generator)
    num_drafts = torch.randint(0, max_drafts + 1, (ROWS,), generator=generator)
    return first, seeds, positions, num_drafts


@pytest.mark.parametrize("max_drafts", [1, 5, 8])
def test_seed_exact_is_identical_to_plain_sampling_for_every_seed(max_drafts):
    generator, target, draft = _chains(21 + max_drafts)
    first, seeds, positions, num_drafts = _requests(generator, max_drafts)
    plain = generate_plain(target, first, seeds, positions, LENGTH, is_greedy=False)
    run = generate_speculative(
        target, draft, first, seeds, positions, LENGTH, num_drafts, "seed_exact"
    )
    assert torch.equal(run.tokens, plain)
    # Speculation did real work: some steps committed more than one token.
    assert int(run.num_steps.sum()) < ROWS * LENGTH


def test_seed_exact_tokens_depend_on_the_seed():
    generator, target, draft = _chains(31)
    first, seeds, positions, num_drafts = _requests(generator, 5)
    base = generate_speculative(
        target, draft, first, seeds, positions, LENGTH, num_drafts, "seed_exact"
    )
    other = generate_speculative(
        target, draft, first, seeds + 1, positions, LENGTH, num_drafts, "seed_exact"
    )
    assert float((base.tokens != other.tokens).double().mean()) > 0.3


@pytest.mark.parametrize("max_drafts", [1, 5])
def test_greedy_is_identical_to_plain_greedy_with_long_accepted_runs(max_drafts):
    generator, target, draft = _chains(41 + max_drafts)
    first, seeds, positions, _ = _requests(generator, max_drafts)
    num_drafts = torch.full((ROWS,), max_drafts)
    plain = generate_plain(target, first, seeds, positions, LENGTH, is_greedy=True)
    run = generate_speculative(target, draft, first, seeds, positions, LENGTH, num_drafts, "greedy")
    assert torch.equal(run.tokens, plain)
    tokens_per_step = ROWS * LENGTH / int(run.num_steps.sum())
    assert tokens_per_step > 1.0 + 0.5 * max_drafts / (max_drafts + 1)


@pytest.mark.parametrize("mode", ["greedy", "seed_exact"])
def test_variable_length_verification_keeps_outputs_identical(mode):
    generator, target, draft = _chains(61)
    first, seeds, positions, _ = _requests(generator, 5)
    num_drafts = torch.full((ROWS,), 5)
    plain = generate_plain(target, first, seeds, positions, LENGTH, is_greedy=mode == "greedy")
    fixed = generate_speculative(target, draft, first, seeds, positions, LENGTH, num_drafts, mode)
    varlen = generate_speculative(
        target, draft, first, seeds, positions, LENGTH, num_drafts, mode, cost_curve=CURVE
    )
    assert torch.equal(fixed.tokens, plain) and torch.equal(varlen.tokens, plain)
    # The planner verified fewer drafts than the fixed width, yet some rows several per step.
    fixed_rate = fixed.num_verified_drafts.sum() / fixed.num_steps.sum()
    varlen_rate = varlen.num_verified_drafts.sum() / varlen.num_steps.sum()
    assert 0.5 < float(varlen_rate) < float(fixed_rate) == 5.0


def test_drafting_with_the_target_noise_key_raises_acceptance_and_stays_exact():
    generator, target, draft = _chains(51)
    first, seeds, positions, _ = _requests(generator, 5)
    num_drafts = torch.full((ROWS,), 5)
    plain = generate_plain(target, first, seeds, positions, LENGTH, is_greedy=False)
    independent = generate_speculative(
        target, draft, first, seeds, positions, LENGTH, num_drafts, "seed_exact"
    )
    coupled = generate_speculative(
        target, draft, first, seeds, positions, LENGTH, num_drafts, "seed_exact",
        draft_stream=rng.STREAM_SAMPLE,
    )  # fmt: skip
    assert torch.equal(independent.tokens, plain) and torch.equal(coupled.tokens, plain)
    assert int(coupled.num_steps.sum()) < 0.8 * int(independent.num_steps.sum())
