"""DSpark driven as the engine will: target ``forward_step`` (taps) -> ``mtp.seed`` -> propose.

Invariants: the drafts after a chunked prefill equal those after the whole prefill, and a
request's drafts do not depend on the other requests of the step.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.mtp import DSparkDraft

from .test_mtp import BLOCK, VOCAB, randomise, tiny_config


def setup(v41):
    cfg = tiny_config(v41)
    model = build_model(cfg, device="cpu", dtype=torch.float32, include_mtp=True)
    assert isinstance(model.mtp, DSparkDraft)
    randomise(model, 7)
    return cfg, model


def new_cache(cfg, model):
    layout = CacheLayout(num_blocks=1, num_slots=2, max_draft=BLOCK)
    cache = ModelCache(cfg, layout, dtype=torch.float32)
    model.mtp.allocate(cache)
    return cache


def target_step(model, cache, chunks):
    """One flat-batch target forward over ``chunks`` = [(slot, start, ids)]; seeds the drafter
    with the step's taps and returns the greedy token after each chunk's last position."""
    lens = torch.tensor([len(t) for _, _, t in chunks])
    last_rows = lens.cumsum(0) - 1
    batch = ForwardBatch(
        input_ids=torch.cat([t for _, _, t in chunks]),
        positions=torch.cat([torch.arange(s, s + len(t)) for _, s, t in chunks]),
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        seq_lens=torch.tensor([s + len(t) for _, s, t in chunks]),
        block_tables=torch.zeros(len(chunks), 1, dtype=torch.long),
        state_slots=torch.tensor([slot for slot, _, _ in chunks]),
        logits_indices=last_rows,
    )
    out = model.forward_step(batch, cache)
    token_slots = batch.state_slots.repeat_interleave(lens)
    model.mtp.seed(out.taps, batch.positions, token_slots, cache, model.rope)
    return out.logits.argmax(-1)


def propose(model, cache, anchors, last_positions, slots):
    return model.mtp.propose(
        anchors,
        torch.tensor(last_positions),
        torch.tensor(slots),
        cache,
        model.embed,
        model.head.weight,
        model.rope,
    )


@pytest.mark.parametrize("v41", [False, True])
def test_drafts_after_chunked_prefill_equal_whole_prefill(v41):
    cfg, model = setup(v41)
    prompt = torch.randint(0, VOCAB - 1, (9,))
    cache = new_cache(cfg, model)
    anchor = target_step(model, cache, [(0, 0, prompt)])
    whole = propose(model, cache, anchor, [8], [0])

    cache = new_cache(cfg, model)
    other = torch.randint(0, VOCAB - 1, (9,))
    start = 0
    for n in (3, 4, 2):  # chunked, batched with another request in slot 1
        chunks = [(1, start, other[start : start + n]), (0, start, prompt[start : start + n])]
        anchors = target_step(model, cache, chunks)
        start += n
    chunked = propose(model, cache, anchors, [8, 8], [1, 0])
    # fp32, different batch compositions: allow a few ulps of logits of magnitude ~10
    torch.testing.assert_close(chunked.logits[1:], whole.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        chunked.confidence_logits[1:], whole.confidence_logits, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(chunked.tokens[1:], whole.tokens)
