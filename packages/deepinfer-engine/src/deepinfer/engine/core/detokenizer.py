"""Incremental detokenisation that never emits half a UTF-8 character.

Byte-level BPE tokens can split a multi-byte character across tokens; decoding such a token
alone yields the replacement character U+FFFD. The detokeniser decodes a short window of
recent tokens and emits what the newest token added to the window's text, only once it no
longer ends in U+FFFD, so streamed text never contains garbage that a later token would have
completed.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5
# The window's start stays put while it is short, so the text up to the read offset is the
# previous decode's and each token costs one decode; past this length the start moves up.
_MAX_WINDOW_TOKENS = 4


class DecodingTokenizer(Protocol):
    """What detokenisation needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas.

    ``window`` holds the recent tokens from the prefix offset on: ``window[:read_offset]``
    are already turned into text (``prefix_text``, their decode), giving the decoder its
    context (leading spaces, merges); tokens from ``read_offset`` on are not emitted yet.
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
        self.window = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self.read_offset = len(self.window)
        self.prefix_text = self._decode(self.window)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        window = self.window
        window.append(token_id)
        text = self._decode(window)
        num_prefix = len(self.prefix_text)
        if len(text) <= num_prefix or text.endswith(REPLACEMENT_CHAR):
            return ""
        if len(window) > _MAX_WINDOW_TOKENS:
            # the window restarts at the tokens this delta emits (their text is the context)
            del window[: self.read_offset]
            self.prefix_text = self._decode(window)
        else:
            self.prefix_text = text
        self.read_offset = len(window)
        return text[num_prefix:]
