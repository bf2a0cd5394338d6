"""The tiny model's DSpark recipe on CPU at micro scale (examples/tiny_model).

- the training forward (all anchors at once, teacher-forced) is the inference math: it gives
  the logits and confidences ``DSparkDraft.propose`` gives, both when propose is fed the real
  tokens and when it drafts greedily (then the training forward is fed the drafted tokens);
- a few optimiser steps on a random backbone make the draft loss go down, and only the draft
  stages change;
- the evaluation on a micro checkpoint (the engine loader) equals a one-anchor-at-a-time
  recomputation, and its acceptance / calibration numbers equal a brute-force count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from examples.tiny_model import dspark_eval as de
from examples.tiny_model import dspark_training as dt

REPO = Path(__file__).resolve().parents[3]
VOCAB, FIRST_TEXT_ID = 512, 17  # the tiny config's vocabulary; ids below 17 are special


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_model(seed=0, block_size=3):
    # training runs the float numerics (the model's rounding has no gradient)
    config = parse_config(
        tiny_v41_config(vision=False, dspark_block_size=block_size), numerics="float"
    )
    model = build_model(config, device="cpu", dtype=torch.float32, include_mtp=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if not t.dtype.is_floating_point:
                continue
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                std = 0.05 if name == "head.weight" else 0.3
                t.copy_(std * torch.randn(t.shape, generator=gen))
    vocab = config.engram_compressed_vocab_size
    model.bind_engram(torch.randint(0, vocab, (config.vocab_size,), generator=gen))
    return model.eval()


def target_taps(model, ids):
    """Taps and logits of every position of ``ids`` ``[B, T]`` (one prefill per row)."""
    runner = SimpleRunner(model, max_seqs=ids.shape[0], max_len=ids.shape[1], block_size=16)
    batch = runner.batch({b: row.tolist() for b, row in enumerate(ids)})
    return dt.run_target(model, batch, runner.cache)


def training_forward(model, ids):
    taps, logits = target_taps(model, ids)
    out = dt.teacher_forced_drafts(model.mtp, model.embed, model.head.weight, model.rope, taps, ids)
    return out, taps, logits


def propose_at(model, taps, ids, picks, sample=None):
    """``DSparkDraft.propose`` for anchors ``picks`` = [(sequence, p)], each in its own slot of
    an engine-sized ring (window + K) seeded with the taps of positions 0..p."""
    cfg, seq_len = model.config, ids.shape[1]
    k = cfg.dspark_block_size
    layout = CacheLayout(num_blocks=1, num_slots=len(picks), max_draft=k)
    cache = ModelCache(cfg, layout, dtype=torch.float32)
    model.mtp.allocate(cache)
    for slot, (b, p) in enumerate(picks):
        rows = torch.arange(b * seq_len, b * seq_len + p + 1)
        slots = torch.full((p + 1,), slot)
        model.mtp.seed(taps[rows], torch.arange(p + 1), slots, cache, model.rope)
    kwargs = {} if sample is None else {"sample": sample}
    return model.mtp.propose(
        torch.stack([ids[b, p + 1] for b, p in picks]),
        torch.tensor([p for _, p in picks]),
        torch.arange(len(picks)),
        cache,
        model.embed,
        model.head.weight,
        model.rope,
        **kwargs,
    )


def anchor_index(picks, seq_len):
    return torch.tensor([b * (seq_len - 1) + p for b, p in picks])


def test_training_forward_equals_propose_fed_the_real_tokens():
    model = random_model(seed=1)
    k = model.config.dspark_block_size
    ids = torch.randint(FIRST_TEXT_ID, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, taps, _ = training_forward(model, ids)
    seq_len = ids.shape[1]
    # anchors with a short history, a full window (8) and more, and at the sequence end
    picks = [(0, 0), (0, 3), (1, 11), (1, 20), (0, seq_len - 2)]
    flat = ids.reshape(-1)
    real_next = torch.stack(
        [flat[[b * seq_len + min(p + 2 + i, seq_len - 1) for i in range(k)]] for b, p in picks]
    )
    with torch.no_grad():
        proposal = propose_at(model, taps, ids, picks, sample=lambda logits, i: real_next[:, i])
    rows = anchor_index(picks, seq_len)
    torch.testing.assert_close(out.logits[rows], proposal.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        out.confidence_logits[rows], proposal.confidence_logits, atol=1e-4, rtol=1e-4
    )
    # the bookkeeping: draft i of anchor p is compared with target row p+1+i, next token p+2+i
    b, p = picks[1]
    assert out.target_rows[rows[1]].tolist() == [b * seq_len + p + 1 + i for i in range(k)]
    assert out.next_tokens[rows[1]].tolist() == ids[b, p + 2 : p + 2 + k].tolist()
    assert out.valid[rows[-1]].tolist() == [True] + [False] * (k - 1)


def test_training_forward_equals_greedy_propose_on_the_drafted_tokens():
    model = random_model(seed=3)
    k = model.config.dspark_block_size
    ids = torch.randint(FIRST_TEXT_ID, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    picks = [(0, 2), (1, 9), (2, 14)]  # one anchor per sequence, all k drafts inside it
    with torch.no_grad():
        taps, _ = target_taps(model, ids)
        greedy = propose_at(model, taps, ids, picks)
        drafted = ids.clone()  # write the drafts in after each anchor: x[p+2+i] = draft i
        for (b, p), tokens in zip(picks, greedy.tokens):
            drafted[b, p + 2 : p + 1 + k] = tokens[: k - 1]
        out, _, _ = training_forward(model, drafted)
    rows = anchor_index(picks, ids.shape[1])
    torch.testing.assert_close(out.logits[rows], greedy.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        out.confidence_logits[rows], greedy.confidence_logits, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(out.logits[rows].argmax(-1), greedy.tokens)


def test_a_few_steps_lower_the_draft_loss_and_train_only_the_drafts():
    torch.manual_seed(0)
    model = random_model(seed=5)
    ids = torch.randint(FIRST_TEXT_ID, VOCAB, (2, 32), generator=torch.Generator().manual_seed(6))
    taps, logits = target_taps(model, ids)
    dt.init_draft_heads_(model.mtp)
    params = dt.draft_parameters(model.mtp)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "mtp." not in n}
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(6):
        out = dt.teacher_forced_drafts(
            model.mtp, model.embed, model.head.weight, model.rope, taps, ids
        )
        loss, metrics = dt.dspark_loss(out, logits)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        for term in ("ce", "tv", "bce"):
            assert torch.isfinite(metrics[term])
    assert losses[-1] < 0.9 * losses[0], losses
    # every trainable tensor got a gradient; the backbone (embedding, head) did not move
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    for name, p in model.named_parameters():
        if "mtp." not in name:
            assert torch.equal(p, frozen[name]), name


@pytest.mark.parametrize("confidence_target", ["tv", "greedy"])
def test_loss_terms_match_their_definitions(confidence_target):
    gen = torch.Generator().manual_seed(7)
    n, k, vocab = 4, 3, 11
    logits = torch.randn(n, k, vocab, generator=gen)
    conf = torch.randn(n, k, generator=gen)
    target = torch.randn(6, vocab, generator=gen)
    rows = torch.randint(0, 6, (n, k), generator=gen)
    valid = torch.rand(n, k, generator=gen) > 0.3
    valid[0, 0] = True
    labels = target[rows].argmax(-1)
    # the real next tokens: the greedy label or not, so that both paths occur
    next_tokens = torch.where(torch.rand(n, k, generator=gen) < 0.6, labels, (labels + 1) % vocab)
    weights = dt.LossWeights(
        cross_entropy=0.7,
        total_variation=1.3,
        confidence=0.4,
        decay=2.0,
        off_path=0.3,
        confidence_target=confidence_target,
    )
    outputs = dt.DraftOutputs(logits, conf, rows, valid, next_tokens)
    loss, _ = dt.dspark_loss(outputs, target, weights)
    total = norm = 0.0
    for a in range(n):
        for i in range(k):
            if not valid[a, i]:
                continue
            on_path = all(next_tokens[a, j] == labels[a, j] for j in range(i))
            p = torch.softmax(target[rows[a, i]], -1)
            q = torch.softmax(logits[a, i], -1)
            tv = 0.5 * (p - q).abs().sum()
            ce = -torch.log(q[p.argmax()])
            c = torch.sigmoid(conf[a, i])
            y = 1 - tv if confidence_target == "tv" else float(q.argmax() == p.argmax())
            bce = -(y * torch.log(c) + (1 - y) * torch.log(1 - c))
            w = float(np.exp(-i / 2.0)) * (1.0 if on_path else 0.3)
            total += w * (0.7 * ce + 1.3 * tv + 0.4 * bce)
            norm += w
    torch.testing.assert_close(loss, torch.as_tensor(total / norm, dtype=torch.float32))


@pytest.fixture(scope="module")
def micro_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro") / "ckpt"
    return make_random_checkpoint(path, tiny_v41_config(vision=False), quantized=True, seed=8)


def brute_force_drafts(model, prefixes):
    """One anchor at a time: greedy decode token by token, propose from its own cache."""
    k = model.config.dspark_block_size
    drafts, greedy, conf = [], [], []
    for prefix in prefixes:
        length = len(prefix)
        runner = SimpleRunner(model, max_seqs=1, max_len=length + k, block_size=16, max_draft=k)
        model.mtp.allocate(runner.cache)
        tokens = []
        for step in range(k):
            feed = prefix.tolist() if step == 0 else [tokens[-1]]
            batch = runner.batch({0: feed})
            out = model.forward_step(batch, runner.cache)
            runner.lengths[0] = runner.lengths.get(0, 0) + len(feed)
            if step == 0:
                seeded = batch.positions <= length - 2
                slots = torch.zeros(int(seeded.sum()), dtype=torch.long)
                model.mtp.seed(
                    out.taps[seeded], batch.positions[seeded], slots, runner.cache, model.rope
                )
                proposal = model.mtp.propose(
                    prefix[-1:],
                    torch.tensor([length - 2]),
                    torch.tensor([0]),
                    runner.cache,
                    model.embed,
                    model.head.weight,
                    model.rope,
                )
            tokens.append(int(out.logits[-1].argmax()))
        drafts.append(proposal.tokens[0])
        greedy.append(torch.tensor(tokens))
        conf.append(proposal.confidence_logits[0])
    return torch.stack(drafts), torch.stack(greedy), torch.stack(conf)


def test_evaluation_equals_one_anchor_at_a_time(micro_checkpoint):
    model = de.load_checkpoint_with_drafts(micro_checkpoint, "cpu", torch.float32)
    assert model.config.numerics == "model"  # the shipped numerics
    gen = torch.Generator().manual_seed(9)
    prefixes = torch.randint(FIRST_TEXT_ID, VOCAB, (5, 14), generator=gen)
    raw = de.draft_and_verify(model, prefixes, chunk=3)
    with torch.no_grad():
        drafts, greedy, conf = brute_force_drafts(model, prefixes)
    assert torch.equal(raw["greedy"], greedy)
    assert torch.equal(raw["drafts"], drafts)
    torch.testing.assert_close(raw["confidence_logits"], conf, atol=1e-4, rtol=1e-4)


def brute_force_metrics(drafts, greedy, conf_logits, num_bins=10):
    n, k = drafts.shape
    accepted = []
    for a in range(n):
        count = 0
        while count < k and drafts[a, count] == greedy[a, count]:
            count += 1
        accepted.append(count)
    pairs = []  # (position, confidence, accepted) for every position reached
    for a in range(n):
        for i in range(min(accepted[a] + 1, k)):
            pairs.append((i, float(torch.sigmoid(conf_logits[a, i].double())), i < accepted[a]))

    def ece_brier(sel):
        if not sel:
            return None, None
        ece = 0.0
        for b in range(num_bins):
            in_bin = [(c, y) for c, y in sel if min(int(c * num_bins), num_bins - 1) == b]
            if in_bin:
                gap = abs(sum(c for c, _ in in_bin) - sum(y for _, y in in_bin))
                ece += gap / len(sel)
        brier = sum((c - y) ** 2 for c, y in sel) / len(sel)
        return ece, brier

    per_position = [ece_brier([(c, y) for i, c, y in pairs if i == pos]) for pos in range(k)]
    return sum(accepted) / n, ece_brier([(c, y) for _, c, y in pairs]), per_position


def test_acceptance_and_calibration_equal_a_brute_force_count():
    gen = torch.Generator().manual_seed(10)
    n, k = 300, 5
    greedy = torch.randint(0, 4, (n, k), generator=gen)
    # drafts right ~70% of the time, confidences loosely informative
    right = torch.rand(n, k, generator=gen) < 0.7
    drafts = torch.where(right, greedy, (greedy + 1) % 4)
    conf = torch.randn(n, k, generator=gen) + 1.5 * right.float() - 0.5
    m = de.acceptance_metrics(drafts, greedy, conf)
    mean_accepted, (ece, brier), per_position = brute_force_metrics(drafts, greedy, conf)
    assert 0 <= m["mean_accepted_drafts"] <= k
    assert m["mean_accepted_drafts"] == pytest.approx(mean_accepted)
    assert m["accepted_length_per_verify_step"] == pytest.approx(mean_accepted + 1)
    assert 0 <= m["ece"] <= 1 and m["ece"] == pytest.approx(ece)
    assert m["brier"] == pytest.approx(brier)
    for row, (pos_ece, pos_brier) in zip(m["per_position"], per_position):
        assert row["ece"] == pytest.approx(pos_ece)
        assert row["brier"] == pytest.approx(pos_brier)
    assert sum(m["accepted_drafts_histogram"]) == n


def test_eval_script_on_a_micro_checkpoint(micro_checkpoint, tmp_path):
    gen = np.random.default_rng(11)
    tokens = gen.integers(FIRST_TEXT_ID, VOCAB, size=400).astype(np.uint16)
    tokens.tofile(tmp_path / "validation.bin")
    out = tmp_path / "dspark_results.json"
    argv = ["--checkpoint", str(micro_checkpoint), "--device", "cpu", "--dtype", "float32"]
    argv += ["--anchors", "6", "--prefix-len", "12", "--chunk", "4", "--out", str(out)]
    argv += ["--data-dir", str(tmp_path), "--accelerator", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the single thread of this module's tests
    module = "examples.tiny_model.dspark_eval"
    subprocess.run([sys.executable, "-m", module, *argv], check=True, cwd=REPO, env=env)
    results = json.loads(out.read_text())
    m = results["models"]["exported checkpoint"]
    k = m["block_size"]
    assert m["num_anchors"] == 6 and 0 <= m["mean_accepted_drafts"] <= k
    assert m["accepted_length_per_verify_step"] == pytest.approx(m["mean_accepted_drafts"] + 1)
    assert 0 <= m["ece"] <= 1 and 0 <= m["brier"] <= 1
    prefixes = de.sample_prefixes(tokens, 6, 12, seed=0)
    model = de.load_checkpoint_with_drafts(micro_checkpoint, "cpu", torch.float32)
    with torch.no_grad():
        drafts, greedy, conf = brute_force_drafts(model, prefixes)
    mean_accepted, (ece, brier), _ = brute_force_metrics(drafts, greedy, conf)
    assert m["mean_accepted_drafts"] == pytest.approx(mean_accepted)
    assert m["ece"] == pytest.approx(ece, abs=1e-5)
    assert m["brier"] == pytest.approx(brier, abs=1e-5)
