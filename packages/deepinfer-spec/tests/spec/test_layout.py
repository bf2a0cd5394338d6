"""Padded <-> flat varlen layouts of drafts and verify rows."""

import pytest
import torch

from deepinfer.spec import (
    PAD_TOKEN_ID,
    accept_greedy,
    build_verify_rows,
    counts_from_cu,
    cu_from_counts,
    cu_num_verify_tokens,
    pad_drafts,
    pad_verify_rows,
    padded_to_varlen,
    varlen_to_padded,
)


def test_round_trip_between_flat_and_padded():
    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1])
    cu = cu_from_counts(counts)
    assert cu.tolist() == [0, 3, 3, 8, 9]
    assert torch.equal(counts_from_cu(cu), counts)
    flat = torch.randn(9, 4, generator=generator)
    padded = varlen_to_padded(flat, cu, 5, fill=float("nan"))
    assert padded.shape == (4, 5, 4)
    for b in range(4):
        start, end = int(cu[b]), int(cu[b + 1])
        assert torch.equal(padded[b, : end - start], flat[start:end])
        assert torch.isnan(padded[b, end - start :]).all()
    assert torch.equal(padded_to_varlen(padded, counts), flat)


def test_varlen_to_padded_checks_width_and_handles_empty():
    cu = cu_from_counts(torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="max_len=3"):
        varlen_to_padded(torch.arange(6), cu, 3, fill=0)
    empty = varlen_to_padded(torch.empty(0, 2), cu_from_counts(torch.tensor([0, 0])), 2, fill=7.0)
    assert empty.shape == (2, 2, 2) and (empty == 7.0).all()


def test_flat_verify_batch_gives_the_same_acceptance_as_padded():
    generator = torch.Generator().manual_seed(2)
    counts = torch.tensor([2, 0, 4, 3])
    cu = cu_from_counts(counts)
    flat_drafts = torch.randint(0, 9, (int(counts.sum()),), generator=generator)
    # Target tokens: one row per query token, drafts + 1 rows per request, mostly matching.
    cu_rows = cu_num_verify_tokens(cu)
    assert cu_rows.tolist() == [0, 3, 4, 9, 13]
    flat_target = torch.randint(0, 9, (int(cu_rows[-1]),), generator=generator)
    for b in range(4):
        start, count = int(cu_rows[b]), int(counts[b])
        flat_target[start : start + count] = flat_drafts[int(cu[b]) : int(cu[b]) + count]
    flat_target[int(cu_rows[2]) + 2] = (flat_target[int(cu_rows[2]) + 2] + 1) % 9
    drafts, num_drafts = pad_drafts(flat_drafts, cu, 4)
    assert (drafts[1] == PAD_TOKEN_ID).all() and torch.equal(num_drafts, counts)
    target = pad_verify_rows(flat_target, cu, 4, fill=PAD_TOKEN_ID)
    result = accept_greedy(drafts, num_drafts, target)
    assert result.num_accepted.tolist() == [2, 0, 2, 3]
    finals = [int(flat_target[int(cu_rows[b]) + int(n)]) for b, n in enumerate(result.num_accepted)]
    assert result.final_tokens.tolist() == finals


def test_build_verify_rows_lays_out_anchor_then_drafts():
    generator = torch.Generator().manual_seed(3)
    anchors = torch.randint(0, 50, (4,), generator=generator)
    anchor_positions = torch.randint(10, 1000, (4,), generator=generator)
    drafts = torch.randint(0, 50, (4, 5), generator=generator)
    num_verify = torch.tensor([2, 0, 5, 1])
    rows = build_verify_rows(anchors, anchor_positions, drafts, num_verify)
    want_ids, want_positions, want_requests = [], [], []
    for b in range(4):
        count = int(num_verify[b])
        want_ids += [int(anchors[b])] + drafts[b, :count].tolist()
        want_positions += [int(anchor_positions[b]) + j for j in range(count + 1)]
        want_requests += [b] * (count + 1)
    assert rows.input_ids.tolist() == want_ids
    assert rows.positions.tolist() == want_positions
    assert rows.request_index.tolist() == want_requests
    assert torch.equal(rows.cu_num_verify_tokens, cu_num_verify_tokens(cu_from_counts(num_verify)))
    known_total = build_verify_rows(anchors, anchor_positions, drafts, num_verify, num_rows=12)
    assert torch.equal(known_total.input_ids, rows.input_ids)
    no_drafts = build_verify_rows(anchors, anchor_positions, drafts[:, :0], torch.zeros(4))
    assert torch.equal(no_drafts.input_ids, anchors)
