"""Engram: n-gram windows (chunked == whole, rollback), FP8 tables, the gate formula."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.engram import Engram, EngramConfig, EngramHasher
from deepinfer.engine.model.engram_hashing import EngramHashLayout
from deepinfer.engine.model.engram_history import (
    history_ring_size,
    new_history,
    ngram_token_ids,
    reset_history,
    update_history,
)
from deepinfer.engine.model.layers import LinearFactory

N = 4  # max_ngram_size
PAD = 2
VOCAB = 40


def windows_by_hand(tokens, images, cmap, n=N, pad=PAD):
    """Spec 7.3 transcribed: look back t, t-1, ...; before start or image -> pad from there on."""
    out = []
    for t in range(len(tokens)):
        row, blocked = [], False
        for k in range(n):
            q = t - k
            blocked = blocked or q < 0 or images[q]
            row.append(cmap[pad] if blocked else cmap[tokens[q]])
        out.append(row)
    return out


def _token_map():
    # a random many-to-one map, like the normalised tokenizer vocabulary
    return torch.randint(0, 25, (VOCAB,))


def _run_schedule(seqs, schedule, cmap, history):
    """seqs: {slot: (tokens, images)}; schedule: list of steps, each {slot: chunk_len}."""
    done = {slot: 0 for slot in seqs}
    got = {slot: [] for slot in seqs}
    for step in schedule:
        tok, pos, slots, img = [], [], [], []
        for slot, length in step.items():
            start = done[slot]
            tok += seqs[slot][0][start : start + length]
            img += seqs[slot][1][start : start + length]
            pos += range(start, start + length)
            slots += [slot] * length
            done[slot] += length
        args = [torch.tensor(v) for v in (tok, pos, slots)]
        barrier = torch.tensor(img)
        windows = ngram_token_ids(*args, cmap, history, PAD, N, is_barrier=barrier)
        update_history(history, *args, cmap, is_barrier=barrier)
        counts = [length for length in step.values()]
        for slot, rows in zip(step, windows.split(counts)):
            got[slot] += rows.tolist()
    return got


def _random_sequence(length, with_images):
    tokens = torch.randint(0, VOCAB, (length,)).tolist()
    images = [False] * length
    if with_images:
        images[4:7] = [True] * 3
    return tokens, images


def test_chunked_flat_batches_equal_whole_sequences():
    cmap = _token_map()
    seqs = {
        2: _random_sequence(11, False),
        0: _random_sequence(7, True),
        3: _random_sequence(15, True),
    }
    schedule = [{2: 3, 0: 7, 3: 1}, {2: 1, 3: 1}, {2: 5, 3: 4}, {2: 2, 3: 9}]
    history = new_history(4, history_ring_size(N, 3))  # ring 6 < the 9-token chunk
    got = _run_schedule(seqs, schedule, cmap, history)
    for slot, (tokens, images) in seqs.items():
        assert got[slot] == windows_by_hand(tokens, images, cmap.tolist()), f"slot {slot}"


def test_rejected_drafts_need_no_undo_when_the_ring_covers_the_rollback():
    cmap = _token_map()
    tokens, images = _random_sequence(12, False)
    want = windows_by_hand(tokens, images, cmap.tolist())
    for ring, should_match in ((history_ring_size(N, 3), True), (N - 1, False)):
        history = new_history(1, ring)
        _run_schedule({0: (tokens, images)}, [{0: 6}], cmap, history)
        # verify [token 6, three wrong drafts] at positions 6..9; only token 6 is accepted
        drafts = [(t + 1) % VOCAB for t in tokens[7:10]]
        args = [torch.tensor(v) for v in ([tokens[6], *drafts], [6, 7, 8, 9], [0] * 4)]
        ngram_token_ids(*args, cmap, history, PAD, N)
        update_history(history, *args, cmap)
        rows = ngram_token_ids(
            torch.tensor(tokens[7:]),
            torch.arange(7, 12),
            torch.zeros(5, dtype=torch.long),
            cmap,
            history,
            PAD,
            N,
        )
        assert (rows.tolist() == want[7:]) is should_match


def test_reset_history_starts_a_new_sequence():
    cmap = _token_map()
    tokens, images = _random_sequence(5, False)
    history = new_history(2, 5)
    _run_schedule({1: (tokens, images)}, [{1: 5}], cmap, history)
    reset_history(history, torch.tensor([1]))
    got = _run_schedule({1: (tokens, images)}, [{1: 2}, {1: 3}], cmap, history)
    assert got[1] == windows_by_hand(tokens, images, cmap.tolist())


def _engram(quantized, layer_id, dtype=torch.bfloat16):
    model_cfg = _tiny_v41_config(quantized)
    cfg = EngramConfig.from_model_config(model_cfg, layer_id)
    return Engram(cfg, LinearFactory(model_cfg, dtype)), cfg


def _tiny_v41_config(quantized):
    text = {
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "compress_ratios": [0, 0, 2, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 3],
        "index_source_layer_ids": [2, 3],
        "hc_mult": 4,
        "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 3],
        "engram_num_embeddings": [300, 310],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 50,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 40,
    }
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    if quantized:
        raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    return parse_config(raw)


@pytest.mark.parametrize("quantized", [False, True])
def test_parameters_carry_the_checkpoint_names_shapes_and_dtypes(quantized):
    engram, _ = _engram(quantized, 3)
    got = {k: (tuple(v.shape), v.dtype) for k, v in engram.state_dict().items()}
    table = torch.float8_e4m3fn if quantized else torch.bfloat16
    want = {
        "embed.weight": ((310, 64), table),
        "wkv.weight": ((5 * 64, 4 * 64), table),
        "q_weight": ((4, 64), torch.bfloat16),
        "k_weight": ((4, 64), torch.bfloat16),
    }
    if quantized:
        want["embed.scale"] = ((310, 2), torch.float8_e8m0fnu)
        want["wkv.scale"] = ((10, 8), torch.float8_e8m0fnu)
    assert got == want


def test_from_model_config_rejects_a_layer_without_engram():
    with pytest.raises(ValueError, match="layer_id = 2"):
        EngramConfig.from_model_config(_tiny_v41_config(False), 2)


def test_fp8_table_rows_dequantise_with_one_power_of_two_per_32_columns():
    engram, _ = _engram(True, 1)
    weight = torch.full((300, 64), 1.5)
    weight[7, 40] = -3.0
    engram.embed.weight.copy_(weight.to(torch.float8_e4m3fn))
    exponents = torch.full((300, 2), 127, dtype=torch.uint8)
    exponents[7] = torch.tensor([125, 130], dtype=torch.uint8)  # 2^-2, 2^3
    engram.embed.scale.copy_(exponents.view(torch.float8_e8m0fnu))
    rows = engram.embed(torch.tensor([[7, 0]]), torch.float32)
    assert rows.shape == (1, 2, 64)
    assert rows[0, 0, :32].tolist() == [0.375] * 32
    assert rows[0, 0, 40].item() == -24.0 and rows[0, 0, 33].item() == 12.0
    assert rows[0, 1].tolist() == [1.5] * 64


def engram_by_formula(h, rows, w_kv, q_w, k_w, mask, eps):
    """Spec 7.3 written out per (token, stream) in float64."""
    h, rows, w_kv = h.double(), rows.double(), w_kv.double()
    num_tokens, streams, dim = h.shape
    kv = rows.reshape(num_tokens, -1) @ w_kv.t()
    out = h.clone()
    for t in range(num_tokens):
        if not mask[t]:
            continue
        value = kv[t, streams * dim :]
        for j in range(streams):
            key = kv[t, j * dim : (j + 1) * dim]
            hn = h[t, j] / torch.sqrt((h[t, j] ** 2).mean() + eps)
            kn = key / torch.sqrt((key**2).mean() + eps)
            dot = float((hn * q_w[j].double() * k_w[j].double() * kn).sum()) / math.sqrt(dim)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            out[t, j] = h[t, j] + gate * value
    return out


def _randomise(engram, quantized):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engram.parameters():
            if p.dtype == torch.float8_e8m0fnu:
                exps = torch.randint(119, 124, p.shape, generator=g, dtype=torch.uint8)
                p.copy_(exps.view(torch.float8_e8m0fnu))
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 2).to(p.dtype))
        engram.q_weight.add_(3.0)
        engram.k_weight.add_(3.0)


def _dequant(engram):
    wkv = engram.wkv
    if wkv.scale is None:
        return wkv.weight.float()
    s = wkv.scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    return wkv.weight.float() * s[: wkv.weight.shape[0], : wkv.weight.shape[1]]


@pytest.mark.parametrize("quantized", [False, True])
def test_forward_matches_the_spec_formula(quantized):
    """fp32 against the formula in float64. The inputs are seeded: the 2e-5 tolerance is about
    an ulp of the outputs here (values near 190), and on about 6% of random inputs a gate near
    zero, where sqrt(|dot|) is steep, turns the dot's fp32 rounding into 2-8e-5 (measured over
    200 seeds), so unseeded inputs made this test fail at random."""
    engram, cfg = _engram(quantized, 3, torch.float32)
    _randomise(engram, quantized)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, 64, generator=g)
    row_ids = torch.randint(0, 310, (6, 4), generator=g)
    mask = torch.tensor([True, False, True, True, False, True])
    got = engram(hidden, row_ids, mask)
    rows = engram.embed(row_ids, torch.float32)
    want = engram_by_formula(
        hidden, rows, _dequant(engram), engram.q_weight, engram.k_weight, mask, cfg.eps
    )
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[~mask], hidden[~mask])  # image tokens pass through bit-identical
    assert not torch.allclose(got[mask], hidden[mask])


def test_bf16_streams_are_rounded_once_and_masked_rows_untouched():
    engram, cfg = _engram(True, 1)
    _randomise(engram, True)
    hidden = torch.randn(5, 4, 64).bfloat16()
    row_ids = torch.randint(0, 300, (5, 4))
    mask = torch.tensor([True, True, False, True, True])
    got = engram(hidden, row_ids, mask)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[2], hidden[2])
    rows = engram.embed(row_ids, torch.bfloat16)
    kv = engram.wkv(rows.reshape(5, -1))
    want = kernels.OPS["engram_gate"].reference(
        hidden,
        kv[:, :256].reshape(5, 4, 64),
        kv[:, 256:],
        engram.q_weight,
        engram.k_weight,
        mask,
        cfg.eps,
    )
    assert torch.equal(got, want)


def test_hasher_rows_of_chunked_batches_equal_the_whole_sequence():
    layout = EngramHashLayout.build((1, 3), N, 2, 50, 25)
    hasher = EngramHasher(layout, _token_map(), PAD)
    tokens = torch.randint(0, VOCAB, (13,))
    other = torch.randint(0, VOCAB, (13,))
    whole = hasher.row_ids(
        tokens, torch.arange(13), torch.zeros(13, dtype=torch.long), new_history(1, 6)
    )
    history = new_history(2, 6)
    chunks = []
    for start, end in ((0, 5), (5, 6), (6, 13)):
        n = end - start
        ids = torch.cat([other[start:end], tokens[start:end]])
        pos = torch.arange(start, end).repeat(2)
        slots = torch.tensor([0] * n + [1] * n)
        chunks.append(hasher.row_ids(ids, pos, slots, history)[n:])
    assert torch.equal(torch.cat(chunks), whole)
    # the rows are the hash of the n-gram windows written out by hand
    windows = torch.tensor(
        windows_by_hand(tokens.tolist(), [False] * 13, hasher.token_map.tolist())
    )
    want = kernels.engram_hash(windows, layout.multipliers, layout.primes, layout.offsets)
    assert torch.equal(whole, want)
