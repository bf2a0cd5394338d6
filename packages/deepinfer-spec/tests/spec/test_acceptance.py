"""Prefix-match semantics, layouts and batch invariance of the acceptance functions."""

import pytest
import torch

from deepinfer.spec import (
    PAD_TOKEN_ID,
    AcceptanceResult,
    accept_greedy,
    accept_rejection,
    accept_seed_exact,
    matched_prefix,
)

VOCAB = 11


def _random_batch(generator: torch.Generator, batch: int, max_drafts: int):
    drafts = torch.randint(0, VOCAB, (batch, max_drafts), generator=generator)
    counts = torch.randint(0, max_drafts + 1, (batch,), generator=generator)
    return drafts, counts


def _reference_match(drafts, counts, target):
    """Per-request Python loop: walk the drafts until the first mismatch."""
    num_accepted, outputs = [], []
    for b in range(drafts.shape[0]):
        accepted = 0
        while accepted < int(counts[b]) and int(drafts[b, accepted]) == int(target[b, accepted]):
            accepted += 1
        num_accepted.append(accepted)
        outputs.append([int(t) for t in drafts[b, :accepted]] + [int(target[b, accepted])])
    return num_accepted, outputs


@pytest.mark.parametrize("accept", [accept_greedy, accept_seed_exact])
def test_match_equals_per_request_loop(accept):
    generator = torch.Generator().manual_seed(1)
    drafts, counts = _random_batch(generator, 64, 5)
    target = torch.randint(0, VOCAB, (64, 6), generator=generator)
    # Make long accepted runs common: copy the drafts into the target up to a random cut.
    cut = torch.randint(0, 6, (64,), generator=generator)
    copy = torch.arange(5)[None, :] < cut[:, None]
    target[:, :5] = torch.where(copy, drafts, target[:, :5])
    result = accept(drafts, counts, target)
    want_accepted, want_outputs = _reference_match(drafts, counts, target)
    assert result.num_accepted.tolist() == want_accepted
    for b, tokens in enumerate(want_outputs):
        assert result.output_tokens[b, : len(tokens)].tolist() == tokens
        assert (result.output_tokens[b, len(tokens) :] == PAD_TOKEN_ID).all()
        assert int(result.final_tokens[b]) == tokens[-1]
    assert result.output_tokens.dtype == torch.int64
    assert result.num_accepted.dtype == torch.int64


def test_greedy_all_accepted_takes_bonus_row():
    generator = torch.Generator().manual_seed(2)
    drafts = torch.randint(0, VOCAB, (3, 4), generator=generator)
    bonus = torch.randint(0, VOCAB, (3, 1), generator=generator)
    target = torch.cat([drafts, bonus], dim=1)
    result = accept_greedy(drafts, torch.full((3,), 4), target)
    assert result.num_accepted.tolist() == [4, 4, 4]
    assert torch.equal(result.output_tokens, target)
    assert torch.equal(result.num_output_tokens, torch.full((3,), 5))


def test_greedy_none_accepted_takes_target_correction():
    generator = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, VOCAB, (3, 4), generator=generator)
    target = torch.randint(0, VOCAB, (3, 5), generator=generator)
    target[:, 0] = (drafts[:, 0] + 1) % VOCAB
    target[:, 1:4] = drafts[:, 1:4]  # later matches must not count after a mismatch
    result = accept_greedy(drafts, torch.full((3,), 4), target)
    assert result.num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(result.output_tokens[:, 0], target[:, 0])
    assert (result.output_tokens[:, 1:] == PAD_TOKEN_ID).all()


def test_draft_count_limits_acceptance_and_picks_bonus_row():
    generator = torch.Generator().manual_seed(4)
    drafts = torch.randint(0, VOCAB, (2, 5), generator=generator)
    target = torch.cat([drafts, torch.randint(0, VOCAB, (2, 1), generator=generator)], dim=1)
    counts = torch.tensor([2, 0])
    result = accept_greedy(drafts, counts, target)
    assert result.num_accepted.tolist() == [2, 0]
    # The final token comes from row num_draft_tokens[b], the request's own bonus row.
    assert result.output_tokens[0, :3].tolist() == target[0, :3].tolist()
    assert result.final_tokens.tolist() == [int(target[0, 2]), int(target[1, 0])]


def test_padding_draft_is_never_accepted():
    drafts = torch.tensor([[3, PAD_TOKEN_ID, 5]])
    target = torch.tensor([[3, PAD_TOKEN_ID, 5, 7]])
    result = accept_greedy(drafts, torch.tensor([3]), target)
    assert result.num_accepted.tolist() == [1]


def test_zero_width_batch():
    drafts = torch.empty(3, 0, dtype=torch.int64)
    target = torch.randint(0, VOCAB, (3, 1), generator=torch.Generator().manual_seed(5))
    result = accept_greedy(drafts, torch.zeros(3, dtype=torch.int64), target)
    assert result.num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(result.output_tokens, target)


def _random_rejection_inputs(generator, batch, max_drafts):
    drafts, counts = _random_batch(generator, batch, max_drafts)
    draft_probs = torch.softmax(torch.randn(batch, max_drafts, VOCAB, generator=generator), -1)
    target_probs = torch.softmax(torch.randn(batch, max_drafts + 1, VOCAB, generator=generator), -1)
    seeds = torch.randint(0, 2**62, (batch,), generator=generator)
    positions = torch.randint(0, 10_000, (batch,), generator=generator)
    return drafts, counts, draft_probs, target_probs, seeds, positions


def test_rejection_is_batch_invariant_and_reproducible():
    generator = torch.Generator().manual_seed(6)
    inputs = _random_rejection_inputs(generator, 200, 5)
    whole = accept_rejection(*inputs)
    again = accept_rejection(*inputs)
    assert torch.equal(whole.output_tokens, again.output_tokens)
    permutation = torch.randperm(200, generator=generator)
    shuffled = accept_rejection(*(t[permutation] for t in inputs))
    assert torch.equal(shuffled.output_tokens, whole.output_tokens[permutation])
    alone = accept_rejection(*(t[7:8] for t in inputs))
    assert torch.equal(alone.output_tokens, whole.output_tokens[7:8])
    # Wider padding (more slots, same counts) changes nothing either.
    drafts, counts, draft_probs, target_probs, seeds, positions = inputs
    wide = accept_rejection(
        torch.cat([drafts, torch.full((200, 2), PAD_TOKEN_ID)], 1),
        counts,
        torch.cat([draft_probs, torch.rand(200, 2, VOCAB, generator=generator)], 1),
        torch.cat([target_probs, torch.rand(200, 2, VOCAB, generator=generator)], 1),
        seeds,
        positions,
    )
    assert torch.equal(wide.num_accepted, whole.num_accepted)
    assert torch.equal(wide.output_tokens[:, :6], whole.output_tokens)


def test_rejection_accepts_where_target_dominates_and_rejects_impossible_drafts():
    generator = torch.Generator().manual_seed(7)
    drafts, _, draft_probs, target_probs, seeds, positions = _random_rejection_inputs(
        generator, 50, 3
    )
    counts = torch.full((50,), 3)
    # p(d) >= q(d) everywhere: always accepted.
    boosted = target_probs.clone()
    boosted[:, :3].scatter_(-1, drafts[..., None], 5.0)
    boosted = boosted / boosted.sum(-1, keepdim=True)
    q_of_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    assert (boosted[:, :3].gather(-1, drafts[..., None]).squeeze(-1) >= q_of_d).all()
    result = accept_rejection(drafts, counts, draft_probs, boosted, seeds, positions)
    assert result.num_accepted.tolist() == [3] * 50
    # p(d) = 0 at draft 1: never accepted there, and the correction avoids the draft token.
    zeroed = target_probs.clone()
    zeroed[:, 0].scatter_(-1, drafts[:, :1], 5.0)
    zeroed[:, 1].scatter_(-1, drafts[:, 1:2], 0.0)
    zeroed = zeroed / zeroed.sum(-1, keepdim=True)
    result = accept_rejection(drafts, counts, draft_probs, zeroed, seeds, positions)
    assert result.num_accepted.tolist() == [1] * 50
    assert (result.output_tokens[:, 1] != drafts[:, 1]).all()


def test_result_where_merges_rows():
    generator = torch.Generator().manual_seed(8)
    drafts, counts = _random_batch(generator, 6, 3)
    greedy = accept_greedy(drafts, counts, torch.randint(0, VOCAB, (6, 4), generator=generator))
    other = accept_greedy(drafts, counts, drafts.new_zeros(6, 4) + torch.arange(4))
    mask = torch.tensor([True, False, True, False, False, True])
    merged = greedy.where(mask, other)
    for b in range(6):
        source = greedy if mask[b] else other
        assert torch.equal(merged.output_tokens[b], source.output_tokens[b])
        assert int(merged.num_accepted[b]) == int(source.num_accepted[b])
    with pytest.raises(ValueError, match="output_tokens.shape"):
        greedy.where(mask, AcceptanceResult(other.num_accepted, other.output_tokens[:, :2]))


def test_shape_errors_name_the_argument():
    drafts = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_tokens"):
        accept_greedy(drafts, torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        accept_greedy(drafts, torch.tensor([1]), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_greedy(drafts.float(), torch.tensor([1, 2]), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="draft_probs"):
        accept_rejection(
            drafts,
            torch.tensor([1, 2]),
            torch.rand(2, 3, 5),
            torch.rand(2, 4, 6),
            torch.tensor([1, 2]),
            torch.tensor([0, 0]),
        )


def test_matched_prefix_counts_what_accept_by_match_accepts():
    """The host-list form gives each request the count of the batched one (pad drafts too)."""
    g = torch.Generator().manual_seed(5)
    drafts, counts = _random_batch(g, 64, 5)
    drafts[::7, 1] = PAD_TOKEN_ID
    target = torch.randint(0, 3, (64, 6), generator=g)  # small range: long matches happen
    drafts[:, :3] = torch.where(torch.rand(64, 3, generator=g) < 0.7, target[:, :3], drafts[:, :3])
    want = accept_greedy(drafts, counts, target).num_accepted.tolist()
    got = [matched_prefix(drafts[b, : counts[b]].tolist(), target[b].tolist()) for b in range(64)]
    assert got == want
    assert max(want) >= 2  # the case exercises matches, not only first-draft misses
