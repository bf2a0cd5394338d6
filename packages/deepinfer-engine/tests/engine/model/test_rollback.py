"""Rejected drafts roll back: after feeding ``max_draft`` wrong tokens and forgetting them, the
right tokens give the logits of one whole prefill (window rings, compressor partial windows,
compressed entries and Engram history all survive the detour)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.testing.simple_runner import SimpleRunner

from .test_v4_invariants import random_model  # noqa: TID252
from .test_v41_invariants import random_v41_model  # noqa: TID252

MAX_DRAFT = 5


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_rejected_drafts_leave_no_trace(family):
    model = random_model() if family == "v4" else random_v41_model()
    vocab, seq_len = model.config.vocab_size, 140 if family == "v4" else 60
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, vocab, (seq_len,), generator=gen).tolist()
    block = 128 if family == "v4" else 16
    whole = SimpleRunner(model, max_seqs=1, max_len=seq_len, block_size=block).step({0: ids})[0]
    runner = SimpleRunner(
        model, max_seqs=1, max_len=seq_len + MAX_DRAFT, block_size=block, max_draft=MAX_DRAFT
    )
    out, pos = [], 0
    for n in (37, 3, 1, 9, 4):  # accepted chunks; a wrong draft block after each
        out.append(runner.step({0: ids[pos : pos + n]})[0])
        pos += n
        wrong = torch.randint(0, vocab, (MAX_DRAFT,), generator=gen).tolist()
        runner.step({0: wrong})
        runner.rollback(0, MAX_DRAFT)
    out.append(runner.step({0: ids[pos:]})[0])
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-5, rtol=0)
