"""Train byte-level BPE tokenizers that carry the V4 special tokens; the tiny test tokenizer.

The special tokens take ids ``0 .. len(V4_SPECIAL_TOKENS) - 1`` (BOS 0, EOS 1, PAD 2, then the
chat-markup, image and draft-noise tokens); the 256 byte symbols and the learned merges follow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from deepinfer.engine.tokenizer.special_tokens import BOS_TOKEN, V4_SPECIAL_TOKENS
from deepinfer.engine.tokenizer.tokenizer import Tokenizer, TokenizerConfig

_NUM_BYTE_SYMBOLS = 256


def train_byte_level_bpe(
    texts: Iterable[str],
    *,
    vocab_size: int,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = V4_SPECIAL_TOKENS,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` with ``special_tokens`` at ids 0, 1, 2, ...

    ``vocab_size`` counts everything (special tokens, 256 byte symbols, merges). Encoding with
    the post-processor (``add_special_tokens=True`` in ``tokenizers`` / ``transformers``)
    prepends BOS, as the V4 tokenizer does; ``Tokenizer.encode`` controls BOS itself.
    """
    minimum = len(special_tokens) + _NUM_BYTE_SYMBOLS + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size is {vocab_size}; expected at least {minimum}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(special_tokens):
        if backend.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token!r} got id {backend.token_to_id(token)}")
    bos = special_tokens[0] if special_tokens else BOS_TOKEN
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    return Tokenizer(backend, TokenizerConfig())


_TESTING_TEXT = """\
The quick brown fox jumps over the lazy dog. What is the weather in Paris today?
It is sunny with a temperature of 22°C and 45% humidity. 你好，世界！ Größe, café, naïve.
def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

for index in range(10):
    print(index, index * index)
{"location": "Beijing", "unit": "celsius", "days": 3, "ok": true, "items": [1, 2.5, null]}
The user wants to know the weather. I should call the get_weather tool first.
Let me think about this step by step: 17 * 3 = 51, and 51 + 9 = 60.
"""


@functools.lru_cache(maxsize=4)
def _testing_tokenizer_json(vocab_size: int) -> str:
    corpus = [_TESTING_TEXT] * 8 + [line for line in _TESTING_TEXT.splitlines() if line]
    return train_byte_level_bpe(corpus, vocab_size=vocab_size).backend.to_str()


def testing_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A tiny byte-level BPE with every V4 special token (ids 0..16), for tests.

    Trained in memory on a built-in paragraph (English, Python, JSON, a little non-ASCII) in
    a few milliseconds; the trained JSON is cached, each call returns a fresh ``Tokenizer``.
    Any text round-trips through it (byte-level); ``save(directory)`` writes the two files a
    checkpoint directory needs. ``vocab_size`` is an upper bound (274..~528: the built-in text
    runs out of merges); size a model's embedding by ``tokenizer.vocab_size``.
    """
    backend = tokenizers.Tokenizer.from_str(_testing_tokenizer_json(vocab_size))
    return Tokenizer(backend, TokenizerConfig())


testing_tokenizer.__test__ = False  # not a test, although pytest would collect the name
