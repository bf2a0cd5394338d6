"""Engram hashing geometry (V4.1, spec 7.3): compressed-token map, primes, multipliers.

Everything here is a pure function of the tokenizer and the config, computed once at start-up:

- the *compressed token map* folds tokenizer ids whose text normalises alike (NFKC, NFD, strip
  accents, lowercase, collapse whitespace) onto one id; the released V4.1 tokenizer gives
  exactly ``engram_compressed_vocab_size = 99092`` ids, which the hash multipliers depend on;
- per Engram layer, one odd int64 multiplier per look-back (numpy ``default_rng(10007 * layer)``,
  bounded so that ``id * multiplier`` never overflows int64);
- per (layer, n-gram order, head) a distinct prime table size, searched upward from
  ``engram_vocab_size - 1`` and never reused across layers; a layer's primes sum to its
  ``engram_num_embeddings`` entry, which is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MULTIPLIER_SEED_STRIDE = 10007
_INT64_MAX = np.iinfo(np.int64).max
_UNDECODABLE = "\ufffd"
_SPACE_SENTINEL = "\ue000"


def _normalizer() -> Any:
    from tokenizers import Regex, normalizers

    # A token that is exactly one space must survive Strip: swap it for a sentinel and back.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: Any) -> torch.Tensor:
    """``[vocab]`` int64: the compressed id of every tokenizer id (first occurrence order).

    ``tokenizer`` is a ``tokenizers.Tokenizer``, or a wrapper holding one as ``.backend``
    (``deepinfer.engine.tokenizer.Tokenizer``). A token whose decoded text is a partial UTF-8 sequence (contains
    U+FFFD) is keyed by its raw token string; otherwise by its normalised text (or the decoded
    text itself when normalisation leaves nothing); both kinds of key share one namespace.
    """
    tokenizer = getattr(tokenizer, "backend", tokenizer)
    normalize = _normalizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    result = torch.empty(vocab_size, dtype=torch.int64)
    for token_id in range(vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if _UNDECODABLE in text:
            key = str(tokenizer.id_to_token(token_id))
        else:
            key = normalize.normalize_str(text) or text
        result[token_id] = keys.setdefault(key, len(keys))
    return result


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(after: int, used: set[int]) -> int:
    """The smallest prime ``> after`` that is not in ``used``."""
    candidate = after + 1
    while not _is_prime(candidate) or candidate in used:
        candidate += 1
    return candidate


def table_primes(
    num_layers: int, max_ngram_size: int, num_heads: int, engram_vocab_size: int
) -> list[list[int]]:
    """Per layer, the ``(max_ngram_size - 1) * num_heads`` table sizes, order-major."""
    used: set[int] = set()
    layers = []
    for _ in range(num_layers):
        sizes = []
        for _order in range(2, max_ngram_size + 1):
            current = engram_vocab_size - 1
            for _head in range(num_heads):
                current = next_unused_prime(current, used)
                used.add(current)
                sizes.append(current)
        layers.append(sizes)
    return layers


def layer_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """The odd multipliers of one Engram layer, one per look-back (0 = the token itself)."""
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(MULTIPLIER_SEED_STRIDE * layer_id)
    draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


@dataclass(frozen=True)
class EngramHashLayout:
    """The hash geometry of all Engram layers, as the ``engram_hash`` op consumes it.

    multipliers ``[L, N]``, primes and offsets ``[L, (N-1)*H]`` (int64, CPU; move once).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    num_heads: int
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_columns(self) -> int:
        return (self.max_ngram_size - 1) * self.num_heads

    @classmethod
    def build(
        cls,
        layer_ids: tuple[int, ...],
        max_ngram_size: int,
        num_heads: int,
        engram_vocab_size: int,
        compressed_vocab_size: int,
        num_embeddings: tuple[int, ...] = (),
    ) -> EngramHashLayout:
        """Derive the layout; ``num_embeddings`` (the config's table sizes) is checked if given."""
        if not layer_ids or max_ngram_size < 2 or num_heads < 1:
            raise ValueError(
                f"engram geometry layer_ids={layer_ids!r}, max_ngram_size={max_ngram_size}, "
                f"n_heads={num_heads}: expected >= 1 layer, n-gram size >= 2 and >= 1 head"
            )
        if compressed_vocab_size < 1:
            raise ValueError(
                f"engram_compressed_vocab_size = {compressed_vocab_size}: expected >= 1"
            )
        primes = torch.tensor(
            table_primes(len(layer_ids), max_ngram_size, num_heads, engram_vocab_size)
        )
        sums = tuple(int(s) for s in primes.sum(1))
        if num_embeddings and sums != tuple(num_embeddings):
            raise ValueError(
                f"engram_num_embeddings = {tuple(num_embeddings)}: the hash tables derived from "
                f"engram_vocab_size={engram_vocab_size} have {sums} rows"
            )
        offsets = torch.cumsum(primes, 1) - primes
        multipliers = torch.tensor(
            [layer_multipliers(i, max_ngram_size, compressed_vocab_size) for i in layer_ids]
        )
        return cls(tuple(layer_ids), max_ngram_size, num_heads, multipliers, primes, offsets)

    @classmethod
    def from_model_config(cls, cfg: Any) -> EngramHashLayout:
        return cls.build(
            tuple(cfg.engram_layer_ids),
            cfg.engram_max_ngram_size,
            cfg.engram_n_heads,
            cfg.engram_vocab_size,
            cfg.engram_compressed_vocab_size,
            tuple(cfg.engram_num_embeddings),
        )
