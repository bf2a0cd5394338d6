"""DSpark seeding and drafting, checked against the formulas written out: each stage's window
seeded from the taps, the draft block's attention, batching, the Markov head's sequential
decode and the reference rounding of seeded rows."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.engine.model.mtp import DSparkDraft
from deepinfer.engine.model.rope import RopeTables

from .test_mtp import BLOCK, DIM, HEAD_DIM, ROPE_DIM, VOCAB, WINDOW, build, tiny_config  # noqa: TID252


def rope_by_formula(x, positions, theta):
    """Interleaved pairs on the last ROPE_DIM dims (spec 2.3), float64."""
    x = x.double().clone()
    nope = x.shape[-1] - ROPE_DIM
    for t, p in enumerate(positions.tolist()):
        for i in range(ROPE_DIM // 2):
            angle = p * theta ** (-2 * i / ROPE_DIM)
            a, b = x[t, nope + 2 * i].clone(), x[t, nope + 2 * i + 1].clone()
            x[t, nope + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            x[t, nope + 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return x


def rms(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def main_window_kv(draft, cfg, taps, positions):
    first = draft[0]
    main_x = rms(
        taps.double() @ first.main_proj.weight.double().t(),
        first.main_norm.weight,
        cfg.rms_norm_eps,
    )
    out = []
    for stage in draft:
        kv = rms(
            main_x @ stage.attn.wkv.weight.double().t(), stage.attn.kv_norm.weight, cfg.rms_norm_eps
        )
        out.append(rope_by_formula(kv, positions, cfg.rope_theta))
    return out


def test_seed_writes_each_stage_window_from_the_taps():
    cfg, draft, cache, _, _, rope = build()
    positions = torch.arange(0, 9)  # longer than the ring (4 + 3): only the last 7 remain
    taps = torch.randn(9, 2 * DIM)
    draft.seed(taps, positions, torch.full((9,), 1), cache, rope)
    ring = cache.ring_size
    for stage, kv in zip(draft, main_window_kv(draft, cfg, taps, positions)):
        rows = cache[f"{stage.layer_id}.window"]
        for p in range(2, 9):
            torch.testing.assert_close(rows[ring + p % ring].double(), kv[p], atol=1e-5, rtol=1e-5)
        assert rows[:ring].abs().sum() == 0 and rows[2 * ring :].abs().sum() == 0


def draft_attention_by_formula(attn, cfg, x, positions, window_kv, window_valid):
    """The draft block attention of one request written out (float64): every query attends to
    its main window (``window_kv [W, hd]``, ``window_valid [W]``) and to all block K=V."""
    eps, heads = cfg.rms_norm_eps, cfg.num_heads
    xd = x.double()
    qr = rms(xd @ attn.wq_a.weight.double().t(), attn.q_norm.weight, eps)
    q = (qr @ attn.wq_b.weight.double().t()).reshape(len(x), heads, HEAD_DIM)
    q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)  # V4 per-head q norm
    q = torch.stack([rope_by_formula(q[:, h], positions, cfg.rope_theta) for h in range(heads)], 1)
    kv = rope_by_formula(
        rms(xd @ attn.wkv.weight.double().t(), attn.kv_norm.weight, eps), positions, cfg.rope_theta
    )
    keys = torch.cat([window_kv.double()[window_valid], kv])  # [n, hd], K = V
    logits = torch.einsum("thd,nd->thn", q, keys) / math.sqrt(HEAD_DIM)
    sink = attn.attn_sink.double()[None, :, None].expand(len(x), heads, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    o = torch.einsum("thn,nd->thd", probs, keys)
    o = torch.stack([rope_by_formula(o[:, h], -positions, cfg.rope_theta) for h in range(heads)], 1)
    groups, rank = cfg.o_groups, cfg.o_lora_rank
    grouped = o.reshape(len(x), groups, -1)
    wo_a = attn.wo_a.weight.double().reshape(groups, rank, -1)
    z = torch.einsum("tgk,grk->tgr", grouped, wo_a).reshape(len(x), -1)
    return z @ attn.wo_b.weight.double().t()


def _seeded(draft, cache, rope, slot, num_positions, seed):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(num_positions, 2 * DIM, generator=g)
    positions = torch.arange(num_positions)
    draft.seed(taps, positions, torch.full((num_positions,), slot), cache, rope)
    return taps


def test_draft_block_attends_to_its_main_window_and_the_whole_block():
    cfg, draft, cache, embed, _, rope = build()
    _seeded(draft, cache, rope, slot=2, num_positions=3, seed=1)  # p = 2: window -1, 0, 1, 2
    _seeded(draft, cache, rope, slot=0, num_positions=9, seed=2)  # p = 8: window 5..8
    last_pos, slots = torch.tensor([2, 8]), torch.tensor([2, 0])
    _, ctx = draft._block_inputs(torch.tensor([5, 7]), last_pos, slots, cache, embed, rope, BLOCK)
    x = torch.randn(2 * BLOCK, DIM)
    stage = draft[1]
    ring = cache[f"{stage.layer_id}.window"].clone()
    got = stage.attn(x, ctx)
    R = cache.ring_size
    for b, (p, slot) in enumerate(zip(last_pos.tolist(), slots.tolist())):
        main = [p - WINDOW + 1 + i for i in range(WINDOW)]
        window_kv = torch.stack([ring[slot * R + q % R] for q in main])
        valid = torch.tensor([q >= 0 for q in main])
        rows = slice(b * BLOCK, (b + 1) * BLOCK)
        want = draft_attention_by_formula(
            stage.attn, cfg, x[rows], torch.arange(p + 1, p + 1 + BLOCK), window_kv, valid
        )
        torch.testing.assert_close(got[rows].double(), want, atol=1e-5, rtol=1e-5)
    # the block's own rows went to positions p+1..p+K; the window rows are untouched
    after = cache[f"{stage.layer_id}.window"]
    for q in range(5, 9):
        assert torch.equal(after[q % R], ring[q % R])


def _propose(draft, cache, embed, head, rope, tokens, positions, slots):
    return draft.propose(
        torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), cache, embed, head, rope
    )


@pytest.mark.parametrize("v41", [False, True])
def test_a_request_drafts_the_same_alone_and_batched(v41):
    cfg, draft, cache, embed, head, rope = build(v41)
    _seeded(draft, cache, rope, slot=0, num_positions=6, seed=3)
    _seeded(draft, cache, rope, slot=2, num_positions=10, seed=4)
    alone_cache = ModelCache(cfg, cache.layout, dtype=torch.float32)
    alone_cache.tensors = {k: v.clone() for k, v in cache.tensors.items()}
    both = _propose(draft, cache, embed, head, rope, [11, 12], [5, 9], [0, 2])
    alone = _propose(draft, alone_cache, embed, head, rope, [12], [9], [2])
    assert both.tokens.shape == (2, BLOCK) and both.logits.shape == (2, BLOCK, VOCAB)
    # fp32, different batch composition: GEMM blocking differs, so allow a few ulps of ~10
    torch.testing.assert_close(both.logits[1:], alone.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        both.confidence_logits[1:], alone.confidence_logits, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(both.tokens[1:], alone.tokens)
    assert torch.equal(both.tokens, both.logits.argmax(-1))  # greedy by default


@pytest.mark.parametrize("v41", [False, True])
def test_only_the_last_window_of_main_positions_matters(v41):
    cfg, draft, cache, embed, head, rope = build(v41, num_slots=1)
    _seeded(draft, cache, rope, slot=0, num_positions=6, seed=5)  # p = 5: window 2..5
    R = cache.ring_size
    base = _propose(draft, cache, embed, head, rope, [3], [5], [0]).logits
    for stage in draft:  # position 1 is outside the window (its row is stale history)
        cache[f"{stage.layer_id}.window"][1 % R] += 5.0
    torch.testing.assert_close(
        _propose(draft, cache, embed, head, rope, [3], [5], [0]).logits, base, atol=1e-6, rtol=1e-6
    )
    for stage in draft:  # position 2 is inside
        cache[f"{stage.layer_id}.window"][2 % R] += 5.0
    moved = _propose(draft, cache, embed, head, rope, [3], [5], [0]).logits
    assert (moved - base).abs().max() > 1e-3


@pytest.mark.parametrize("v41", [False, True])
def test_stale_draft_rows_never_leak_after_the_accepted_positions_are_seeded(v41, monkeypatch):
    # seeding 6 + 3 rows against 9 at once: equal only where a row's result does not depend on
    # the row count (batch-invariant mode); a leaked stale row would differ by far more
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    cfg, draft, cache, embed, head, rope = build(v41, num_slots=1)
    taps = _seeded(draft, cache, rope, slot=0, num_positions=9, seed=6)
    fresh = ModelCache(cfg, cache.layout, dtype=torch.float32)
    draft.allocate(fresh)
    draft.seed(taps, torch.arange(9), torch.zeros(9, dtype=torch.long), fresh, rope)
    # old cache: seed 0..5, draft a block at 6..8, then seed the verified positions 6..8
    old = ModelCache(cfg, cache.layout, dtype=torch.float32)
    draft.allocate(old)
    draft.seed(taps[:6], torch.arange(6), torch.zeros(6, dtype=torch.long), old, rope)
    _propose(draft, old, embed, head, rope, [4], [5], [0])
    draft.seed(taps[6:], torch.arange(6, 9), torch.zeros(3, dtype=torch.long), old, rope)
    a = _propose(draft, old, embed, head, rope, [9], [8], [0])
    b = _propose(draft, fresh, embed, head, rope, [9], [8], [0])
    torch.testing.assert_close(a.logits, b.logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(a.tokens, b.tokens)


def test_markov_decode_is_sequential_over_the_block():
    _, draft, _, _, _, _ = build()
    last = draft[2]
    hidden, base = torch.randn(2 * BLOCK, DIM), torch.randn(2 * BLOCK, VOCAB)
    seeds = torch.tensor([7, 9])
    calls = []

    def sample(logits, i):
        calls.append(i)
        return (logits.argmax(-1) + i) % VOCAB  # any deterministic pick

    got = draft._markov_decode(last, hidden, base, seeds, BLOCK, sample)
    w1 = last.markov_head.markov_w1.weight.double()
    w2 = last.markov_head.markov_w2.weight.double()
    proj = last.confidence_head.proj.weight.double()[0]
    for b in range(2):
        prev = int(seeds[b])
        for i in range(BLOCK):
            row = b * BLOCK + i
            logits = base[row].double() + w2 @ w1[prev]
            conf = proj @ torch.cat([hidden[row].double(), w1[prev]])
            torch.testing.assert_close(got.logits[b, i].double(), logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                got.confidence_logits[b, i].double(), conf, atol=1e-5, rtol=1e-5
            )
            prev = (int(logits.argmax()) + i) % VOCAB
            assert int(got.tokens[b, i]) == prev
    assert calls == list(range(BLOCK))


def _randomise_stored(module, seed=0):
    """Random weights in their stored formats (FP8 + e8m0 scales, packed FP4, floats)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.float8_e8m0fnu:
                p.copy_(
                    torch.randint(124, 128, p.shape, generator=g, dtype=torch.uint8).view(p.dtype)
                )
            elif p.dtype in (torch.int8, torch.uint8):
                p.copy_(torch.randint(-128, 128, p.shape, generator=g).to(p.dtype))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(p.dtype))


def test_seeded_window_rows_are_fp8_simulated_under_the_reference_numerics():
    from deepinfer import kernels

    quant = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    rows = {}
    for simulate in (False, True):
        cfg = tiny_config(True, quantization_config=quant, head_dim=32)
        cfg = cfg.with_overrides(numerics="model" if simulate else "float")
        draft = DSparkDraft(cfg, LinearFactory(cfg, torch.float32))
        _randomise_stored(draft)
        cache = ModelCache(
            cfg, CacheLayout(num_blocks=1, num_slots=1, max_draft=BLOCK), dtype=torch.float32
        )
        draft.allocate(cache)
        taps = torch.randn(5, 2 * DIM, generator=torch.Generator().manual_seed(3))
        draft.seed(taps, torch.arange(5), torch.zeros(5, dtype=torch.long), cache, RopeTables(cfg))
        rows[simulate] = cache[f"{draft[1].layer_id}.window"][:5]
    # V4.1: the whole row (RoPE tail included) is rounded to e4m3 per 32 with a power-of-two scale
    assert torch.equal(rows[True], kernels.fp8_sim(rows[True], 32))
    assert not torch.equal(rows[False], kernels.fp8_sim(rows[False], 32))
    # ... and otherwise the same rows (the linears' FP8 input rounding adds a little more)
    assert (rows[True] - rows[False]).norm() < 0.1 * rows[False].norm()
