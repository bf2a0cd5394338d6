"""Rejection sampling preserves the target distribution exactly (statistical tests, fixed seeds).

Each test draws ~100k rows in one batched call with a fixed generator, so results are
deterministic; the thresholds (p-value > 1e-4) would catch any systematic bias of a few
thousandths in a cell probability, as the negative controls show.
"""

import pytest
import torch

from deepinfer.sampling import rng
from deepinfer.spec import accept_rejection, draw_categorical
from deepinfer.spec.testing import (
    blend,
    chi_square_p_value,
    generate_plain,
    generate_speculative,
    random_transition,
)

VOCAB = 6
ROWS = 100_000
SIGNIFICANCE = 1e-4


def _fixed_distributions(generator, num_rows, sharpness=1.5):
    return torch.softmax(torch.randn(num_rows, VOCAB, generator=generator) * sharpness, -1)


def _truncate(probs, keep):
    """Zero the tokens outside ``keep`` (as top-k / grammar masks do) and renormalise."""
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[list(keep)] = True
    kept = torch.where(mask, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def _one_step(generator, max_drafts, is_deterministic_draft, is_truncated=False):
    """One verify step over ROWS requests that share p and q but not seeds."""
    target = _fixed_distributions(generator, max_drafts + 1)
    draft = _fixed_distributions(generator, max_drafts)
    if is_truncated:  # overlapping but different supports
        target, draft = _truncate(target, range(0, 4)), _truncate(draft, range(2, VOCAB))
    seeds = torch.randint(0, 2**62, (ROWS,), generator=generator)
    positions = torch.randint(0, 1 << 20, (ROWS,), generator=generator)
    if is_deterministic_draft:
        drafts = draft.argmax(-1).expand(ROWS, max_drafts)
        draft_probs = None
    else:
        rows = draft.repeat(ROWS, 1)
        noise_positions = (positions[:, None] + torch.arange(max_drafts)).reshape(-1)
        drafts = draw_categorical(
            rows, seeds.repeat_interleave(max_drafts), noise_positions, rng.STREAM_DRAFT
        ).view(ROWS, max_drafts)
        draft_probs = draft.expand(ROWS, max_drafts, VOCAB)
    result = accept_rejection(
        drafts,
        torch.full((ROWS,), max_drafts),
        draft_probs,
        target.expand(ROWS, max_drafts + 1, VOCAB),
        seeds,
        positions,
    )
    return target, draft, drafts, result


@pytest.mark.parametrize(
    ("is_deterministic_draft", "is_truncated"), [(False, False), (True, False), (False, True)]
)
def test_first_token_follows_target_and_acceptance_rate_is_min_p_q(
    is_deterministic_draft, is_truncated
):
    generator = torch.Generator().manual_seed(11 + is_deterministic_draft + 2 * is_truncated)
    target, draft, drafts, result = _one_step(generator, 3, is_deterministic_draft, is_truncated)
    counts = torch.bincount(result.output_tokens[:, 0], minlength=VOCAB)
    assert chi_square_p_value(counts, target[0]) > SIGNIFICANCE
    # Every row's rows are context free here, so the token after an accepted first draft
    # follows p_1 as well.
    survivors = result.num_accepted >= 1
    second = torch.bincount(result.output_tokens[survivors, 1], minlength=VOCAB)
    assert chi_square_p_value(second, target[1]) > SIGNIFICANCE
    # P(first draft accepted) = sum_x min(p(x), q(x)) (q one-hot for deterministic drafts).
    q0 = torch.zeros(VOCAB).scatter_(0, drafts[:1, 0], 1.0) if is_deterministic_draft else draft[0]
    want = float(torch.minimum(target[0], q0).sum())
    got = float(survivors.double().mean())
    standard_error = (want * (1 - want) / ROWS) ** 0.5
    assert abs(got - want) < 5 * standard_error


def test_negative_control_the_draft_alone_is_detected():
    generator = torch.Generator().manual_seed(13)
    target, draft, drafts, _ = _one_step(generator, 3, False)
    counts = torch.bincount(drafts[:, 0], minlength=VOCAB)
    assert chi_square_p_value(counts, draft[0]) > SIGNIFICANCE
    assert chi_square_p_value(counts, target[0]) < 1e-12


def _joint_probs(transition, first_previous, length):
    """Exact probability of every continuation of ``length`` tokens, flat ``[V ** length]``."""
    probs = transition[first_previous]
    for _ in range(length - 1):
        last_token = torch.arange(probs.numel()) % VOCAB
        probs = (probs[:, None] * transition[last_token]).reshape(-1)
    return probs


def _joint_counts(tokens):
    codes = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for column in range(tokens.shape[1]):
        codes = codes * VOCAB + tokens[:, column]
    return torch.bincount(codes, minlength=VOCAB ** tokens.shape[1])


def test_multi_step_joint_distribution_matches_the_target_chain():
    generator = torch.Generator().manual_seed(17)
    target = random_transition(VOCAB, generator, sharpness=1.5)
    draft = blend(target, random_transition(VOCAB, generator, sharpness=1.5), 0.5)
    first = torch.full((ROWS,), 2)
    seeds = torch.randint(0, 2**62, (ROWS,), generator=generator)
    positions = torch.randint(0, 1 << 20, (ROWS,), generator=generator)
    num_drafts = torch.randint(0, 5, (ROWS,), generator=generator)
    length = 3
    tokens = generate_speculative(
        target, draft, first, seeds, positions, length, num_drafts, "rejection"
    ).tokens
    want = _joint_probs(target, 2, length)
    assert chi_square_p_value(_joint_counts(tokens), want) > SIGNIFICANCE
    # Control: the same test rejects plain sampling from the draft chain.
    drafted = generate_plain(draft, first, seeds, positions, length, is_greedy=False)
    assert chi_square_p_value(_joint_counts(drafted), want) < 1e-12


def test_without_drafts_the_final_token_is_a_plain_target_draw():
    generator = torch.Generator().manual_seed(19)
    target = _fixed_distributions(generator, 1)
    seeds = torch.randint(0, 2**62, (ROWS,), generator=generator)
    positions = torch.randint(0, 1 << 20, (ROWS,), generator=generator)
    result = accept_rejection(
        torch.empty(ROWS, 0, dtype=torch.int64),
        torch.zeros(ROWS, dtype=torch.int64),
        None,
        target.expand(ROWS, 1, VOCAB),
        seeds,
        positions,
    )
    assert result.num_accepted.eq(0).all()
    counts = torch.bincount(result.output_tokens[:, 0], minlength=VOCAB)
    assert chi_square_p_value(counts, target[0]) > SIGNIFICANCE
