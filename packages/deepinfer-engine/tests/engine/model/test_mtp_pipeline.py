"""DSpark driven as the engine will: target forward with taps -> seed -> propose.

Invariant: the drafts after a chunked prefill equal those after the whole prefill, and a
request's drafts do not depend on the other requests of the step.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.mtp import DSparkDraft
from deepinfer.engine.model.mtp_taps import TapRecorder

from .test_mtp import BLOCK, VOCAB, randomise, tiny_config


def setup(v41):
    cfg = tiny_config(v41)
    model = build_model(cfg, device="cpu", dtype=torch.float32)
    randomise(model, 7)
    draft = DSparkDraft(cfg, LinearFactory(cfg, torch.float32))
    randomise(draft, 8)
    return cfg, model, draft


def new_cache(cfg, draft):
    layout = CacheLayout(num_blocks=1, num_slots=2, max_draft=BLOCK)
    cache = ModelCache(cfg, layout, dtype=torch.float32)
    draft.allocate(cache)
    return cache


def target_step(cfg, model, draft, cache, chunks):
    """One flat-batch target forward over ``chunks`` = [(slot, start, ids)]; seeds the drafter
    and returns the greedy next token of each chunk's last position."""
    ids = torch.cat([c[2] for c in chunks])
    positions = torch.cat([torch.arange(s, s + len(t)) for _, s, t in chunks])
    lens = [len(t) for _, _, t in chunks]
    batch = ForwardBatch(
        input_ids=ids,
        positions=positions,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor([s + len(t) for _, s, t in chunks]),
        block_tables=torch.zeros(len(chunks), 1, dtype=torch.long),
        state_slots=torch.tensor([slot for slot, _, _ in chunks]),
    )
    ctx = model.step_context(batch, cache)
    streams = model.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    recorder, pre = TapRecorder(cfg), None
    if cfg.is_v41:
        pre = torch.zeros(streams.shape[:2])
        pre[:, 0] = 1.0
    for layer in model.layers:
        recorder.before_layer(layer.layer_id, streams)
        if cfg.is_v41:
            streams, pre = layer.forward_v41(streams, pre, ctx)
        else:
            streams = layer(streams, ctx)
        recorder.after_layer(layer.layer_id, streams)
    token_slots = batch.state_slots.repeat_interleave(torch.tensor(lens))
    draft.seed(recorder.taps(), positions, token_slots, cache, model.rope)
    last_rows = torch.tensor(lens).cumsum(0) - 1
    if cfg.is_v41:
        import deepinfer.kernels as K

        y = model.norm(K.hc_collapse(streams[last_rows], pre[last_rows]))
        return K.linear(y.float(), model.head.weight, out_dtype=torch.float32).argmax(-1)
    return model.logits(streams, last_rows).argmax(-1)


def propose(model, draft, cache, anchors, last_positions, slots):
    return draft.propose(
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
    cfg, model, draft = setup(v41)
    prompt = torch.randint(0, VOCAB - 1, (9,))
    cache = new_cache(cfg, draft)
    anchor = target_step(cfg, model, draft, cache, [(0, 0, prompt)])
    whole = propose(model, draft, cache, anchor, [8], [0])

    cache = new_cache(cfg, draft)
    other = torch.randint(0, VOCAB - 1, (9,))
    start = 0
    for n in (3, 4, 2):  # chunked, batched with another request in slot 1
        chunks = [(1, start, other[start : start + n]), (0, start, prompt[start : start + n])]
        anchors = target_step(cfg, model, draft, cache, chunks)
        start += n
    chunked = propose(model, draft, cache, anchors, [8, 8], [1, 0])
    torch.testing.assert_close(chunked.logits[1:], whole.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        chunked.confidence_logits[1:], whole.confidence_logits, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(chunked.tokens[1:], whole.tokens)
