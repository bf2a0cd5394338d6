"""The committed tiny-model tokenizer (examples/tiny_model/tokenizer) loads with the V4 layout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer.engine.tokenizer import (
    V4_SPECIAL_TOKENS,
    encode_messages,
    load_tokenizer,
    parse_completion,
)

TOKENIZER_DIR = Path(__file__).resolve().parents[5] / "examples" / "tiny_model" / "tokenizer"

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="tiny-model tokenizer not in this tree"
)


def test_special_tokens_at_the_documented_ids():
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    assert tokenizer.vocab_size == 8192
    assert [tokenizer.token_to_id(token) for token in V4_SPECIAL_TOKENS] == list(
        range(len(V4_SPECIAL_TOKENS))
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)


def test_python_source_compresses_and_round_trips():
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    rng = random.Random(3)
    names = ["value", "index", "result", "self", "items", "key", "count", "path"]
    lines = [
        f"    {rng.choice(names)} = {rng.choice(names)}.get({rng.randint(0, 99)!r})"
        for _ in range(20)
    ]
    source = "def function(self):\n" + "\n".join(lines) + "\n    return None\n"
    ids = tokenizer.encode(source, add_bos=False)
    assert tokenizer.decode(ids) == source
    assert len(source.encode()) / len(ids) > 2.5  # BPE learned Python, not bytes


def test_chat_round_trip_with_the_tiny_tokenizer():
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    messages = [
        {"role": "user", "content": "Sort [3, 1, 2]"},
        {"role": "assistant", "reasoning_content": "Use sorted().", "content": "sorted([3, 1, 2])"},
    ]
    ids = tokenizer.encode_chat(messages, thinking=True)
    prompt = tokenizer.encode_chat(messages[:1], thinking=True)
    assert ids[: len(prompt)] == prompt and prompt[-1] == tokenizer.special.think_start
    assert tokenizer.decode(ids) == encode_messages(messages, thinking=True)
    parsed = parse_completion(tokenizer.decode(ids[len(prompt) :]), thinking=True, strict=True)
    assert (parsed.reasoning_content, parsed.content) == ("Use sorted().", "sorted([3, 1, 2])")
