"""Incremental detokenisation that never emits half a UTF-8 character.

Byte-level BPE tokens can split a multi-byte character across tokens; decoding such a token
alone yields the replacement character U+FFFD. The detokeniser decodes a short window of
recent tokens twice (up to the last emitted token, and up to the newest one) and emits the
difference only once it no longer ends in U+FFFD, so streamed text never contains garbage
that a later token would have completed.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5


class DecodingTokenizer(Protocol):
    """What detokenisation needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas.

    ``prefix_offset .. read_offset`` is the window of tokens already turned into text that
    gives the decoder its context (leading spaces, merges); tokens from ``read_offset`` on are
    not emitted yet.
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - _INITIAL_CONTEXT_TOKENS, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta
