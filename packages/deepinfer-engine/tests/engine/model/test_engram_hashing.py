"""Engram hashing: a hand-checked hash, the released table sizes, the compressed token map."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.model.engram_hashing import (
    EngramHashLayout,
    compressed_token_map,
    layer_multipliers,
    next_unused_prime,
)


def test_hash_of_a_hand_computed_case():
    # window (t, t-1, t-2) = (3, 5, 7), multipliers (1, 3, 5): products 3, 15, 35.
    # 2-gram: 3 ^ 15 = 0b0011 ^ 0b1111 = 12; 3-gram: 12 ^ 35 = 0b001100 ^ 0b100011 = 47.
    # tables (7, 11 | 13, 17) at offsets (0, 7 | 18, 31):
    # 12 % 7 = 5, 12 % 11 = 1 -> 1 + 7 = 8, 47 % 13 = 8 -> 26, 47 % 17 = 13 -> 44.
    ids = torch.tensor([[3, 5, 7]])
    rows = kernels.engram_hash(
        ids,
        torch.tensor([[1, 3, 5]]),
        torch.tensor([[7, 11, 13, 17]]),
        torch.tensor([[0, 7, 18, 31]]),
    )
    assert rows.tolist() == [[[5, 8, 26, 44]]]


def test_hash_columns_stay_inside_their_prime_ranges():
    layout = EngramHashLayout.build((1, 5), 4, 3, 1000, 97)
    ids = torch.randint(0, 97, (200, 4))
    rows = kernels.engram_hash(ids, layout.multipliers, layout.primes, layout.offsets)
    assert rows.shape == (200, 2, 9)
    low, high = layout.offsets, layout.offsets + layout.primes
    assert bool(((rows >= low) & (rows < high)).all())


def test_layout_reproduces_the_released_v41_table_sizes():
    # engram_vocab_size 16e6, 8 heads, 4-grams, layers 1 and 14 (spec 1.3): the derived primes
    # must sum to the checkpoint's engram_num_embeddings; the constructor checks it.
    layout = EngramHashLayout.build((1, 14), 4, 8, 16_000_000, 99_092, (384_006_168, 384_016_682))
    assert layout.primes.shape == (2, 24)
    assert len(set(layout.primes.flatten().tolist())) == 48  # never reused across layers
    assert bool((layout.offsets[:, 1:] == torch.cumsum(layout.primes, 1)[:, :-1]).all())
    assert bool((layout.multipliers % 2 == 1).all())
    # no int64 overflow for any compressed id
    assert bool((layout.multipliers <= (2**63 - 1) // 99_092).all())


def test_layout_rejects_table_sizes_that_do_not_match():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHashLayout.build((1,), 2, 2, 100, 50, (999,))


def test_multipliers_are_the_seeded_draws_of_each_layer():
    import numpy as np

    bound = (2**63 - 1) // 1234 // 2
    draws = np.random.default_rng(10007 * 3).integers(0, bound, size=4, dtype=np.int64)
    assert layer_multipliers(3, 4, 1234) == [int(d) * 2 + 1 for d in draws]
    assert layer_multipliers(3, 4, 1234) != layer_multipliers(4, 4, 1234)


def test_next_unused_prime_skips_used_primes():
    assert next_unused_prime(10, set()) == 11
    assert next_unused_prime(10, {11, 13}) == 17
    assert next_unused_prime(16_000_000 - 1, set()) == 16_000_057


def _word_level_tokenizer(tokens):
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.decoder = decoders.ByteLevel()
    return tok


def test_compressed_token_map_folds_case_accents_and_whitespace():
    # byte-level alphabet: "Ġ" is a space, "Ċ" a newline, "Ã" / "Ä" lone UTF-8 lead bytes.
    tokens = ["<unk>", "The", "the", "THE", "Ġthe", "Ã©", "e", "Ġ", "Ċ", "ĠĠ", "Ã", "Ä", "x"]
    cmap = compressed_token_map(_word_level_tokenizer(tokens)).tolist()
    ids = {t: cmap[i] for i, t in enumerate(tokens)}
    assert ids["The"] == ids["the"] == ids["THE"]  # lowercase
    assert ids["Ġthe"] == ids["the"]  # surrounding whitespace is stripped
    assert ids["Ã©"] == ids["e"]  # "é" loses its accent
    assert ids["Ġ"] == ids["Ċ"] == ids["ĠĠ"]  # whitespace runs -> one space, which survives
    assert ids["Ã"] != ids["Ä"]  # partial UTF-8 tokens keep distinct raw keys
    assert ids["x"] not in (ids["Ã"], ids["Ä"], ids["e"])
    # ids are dense and assigned in first-occurrence order
    assert sorted(set(cmap)) == list(range(len(set(cmap))))
    assert cmap[0] == 0 and ids["The"] == 1


def test_compressed_token_map_of_a_byte_level_bpe_tokenizer():
    from deepinfer.engine.tokenizer.training import testing_tokenizer

    tok = testing_tokenizer()
    cmap = compressed_token_map(tok)  # the engine's wrapper: reads its tokenizers backend
    backend = tok.backend
    assert cmap.shape == (tok.vocab_size,)
    assert sorted(set(cmap.tolist())) == list(range(int(cmap.max()) + 1))  # dense
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in backend.decode([i])]
    assert partial  # lone UTF-8 bytes exist in a byte-level vocabulary...
    assert len({int(cmap[i]) for i in partial}) == len(partial)  # ...and are never merged
    texts = {}
    for i in range(tok.vocab_size):
        text = backend.decode([i])
        if "\ufffd" not in text and text.strip():
            texts.setdefault(text.strip().lower(), set()).add(int(cmap[i]))
    assert all(len(ids) == 1 for ids in texts.values())  # case / surrounding space folded
    assert len(set(cmap.tolist())) < tok.vocab_size
