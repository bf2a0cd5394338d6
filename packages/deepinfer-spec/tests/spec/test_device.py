"""On an NVIDIA GPU: same results as on the CPU, and no host synchronisation in the hot path."""

import pytest
import torch

from deepinfer.spec import (
    accept_greedy,
    accept_rejection,
    accept_seed_exact,
    build_verify_rows,
    cu_from_counts,
    pad_verify_rows,
    split_verify_slots,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

BATCH, MAX_DRAFTS, VOCAB = 64, 5, 1000


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(torch.randn(BATCH, MAX_DRAFTS, VOCAB, generator=generator), -1)
    target_probs = torch.softmax(
        torch.randn(BATCH, MAX_DRAFTS + 1, VOCAB, generator=generator) * 0.2, -1
    )
    drafts = torch.multinomial(draft_probs.view(-1, VOCAB), 1, generator=generator).view(
        BATCH, MAX_DRAFTS
    )
    counts = torch.randint(0, MAX_DRAFTS + 1, (BATCH,), generator=generator)
    seeds = torch.randint(0, 2**62, (BATCH,), generator=generator)
    positions = torch.randint(0, 1 << 20, (BATCH,), generator=generator)
    return drafts, counts, draft_probs, target_probs, seeds, positions


def _to_cuda(tensors):
    return tuple(t.cuda() for t in tensors)


def test_rejection_matches_cpu_bit_for_bit():
    inputs = _inputs(1)
    on_cpu = accept_rejection(*inputs)
    on_gpu = accept_rejection(*_to_cuda(inputs))
    assert torch.equal(on_gpu.num_accepted.cpu(), on_cpu.num_accepted)
    assert torch.equal(on_gpu.output_tokens.cpu(), on_cpu.output_tokens)


def test_match_and_split_match_cpu():
    drafts, counts, _, target_probs, _, _ = _inputs(2)
    target = target_probs.argmax(-1)
    target[:, :MAX_DRAFTS] = torch.where(
        torch.rand(BATCH, MAX_DRAFTS) < 0.7, drafts, target[:, :MAX_DRAFTS]
    )
    for accept in (accept_greedy, accept_seed_exact):
        on_cpu = accept(drafts, counts, target)
        on_gpu = accept(drafts.cuda(), counts.cuda(), target.cuda())
        assert torch.equal(on_gpu.output_tokens.cpu(), on_cpu.output_tokens)
    confidences = torch.rand(BATCH, MAX_DRAFTS)
    for num_slots in (0, 17, 1000):
        on_cpu = split_verify_slots(confidences, counts, num_slots)
        on_gpu = split_verify_slots(confidences.cuda(), counts.cuda(), num_slots)
        assert torch.equal(on_gpu.cpu(), on_cpu)


def test_hot_path_never_synchronises():
    inputs = _inputs(3)
    num_rows = BATCH + int(inputs[1].sum())
    drafts, counts, draft_probs, target_probs, seeds, positions = _to_cuda(inputs)
    cu = cu_from_counts(counts)
    flat_rows = torch.randn(BATCH * (MAX_DRAFTS + 1), 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        accept_rejection(drafts, counts, draft_probs, target_probs, seeds, positions)
        accept_rejection(drafts, counts, None, target_probs, seeds, positions)
        accept_greedy(drafts, counts, target_probs.argmax(-1))
        split_verify_slots(torch.rand(BATCH, MAX_DRAFTS, device="cuda"), counts, 40)
        pad_verify_rows(flat_rows, cu, MAX_DRAFTS, fill=0.0)
        build_verify_rows(drafts[:, 0], positions, drafts, counts, num_rows=num_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
