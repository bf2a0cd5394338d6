"""Incremental detokenisation that never emits half a UTF-8 character.

Byte-level BPE tokens can split a multi-byte character across tokens; decoding such a token
alone yields the replacement character U+FFFD. The detokeniser decodes a short window of
recent tokens and emits what the newest token added to the window's text, only once it no
longer ends in U+FFFD, so streamed text never contains garbage that a later token would have
completed.

Byte-level tokenizers (``tokenizers``' ``ByteLevel`` decoder) decode a run of vocabulary
tokens as the UTF-8 decode, U+FFFD for bad bytes, of their bytes joined. With a
:class:`TokenBytes` table the detokeniser then skips the window's decode: once the text up
to the read offset ends in a whole character, the window's text is that text plus the
decode of the bytes of the tokens after it. Added tokens (specials, chat markers), which the
tokenizer decodes apart, take the window's decode; the text is the same either way.
"""

from __future__ import annotations

from typing import Any, Protocol

from deepinfer.engine.tokenizer.tokenizer import byte_level_decoder

REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5
# The window's start stays put while it is short, so the text up to the read offset is the
# previous decode's and each token costs one decode; past this length the start moves up.
_MAX_WINDOW_TOKENS = 4


class DecodingTokenizer(Protocol):
    """What detokenisation needs of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenBytes:
    """The bytes of each vocabulary token of a byte-level tokenizer, filled as tokens come.

    ``get(token_id)`` is None for a token the byte path does not cover (an added token, an
    unknown id, one whose bytes do not decode as the tokenizer decodes it alone).
    """

    def __init__(self, tokenizer: DecodingTokenizer, backend: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self._chars = byte_level_decoder()
        self._table: dict[int, bytes | None] = dict.fromkeys(backend.get_added_tokens_decoder())

    @classmethod
    def of(cls, tokenizer: Any) -> TokenBytes | None:
        """A table for ``tokenizer`` (or the ``tokenizers.Tokenizer`` it wraps as
        ``backend``) when its decoder is exactly ``ByteLevel``; None otherwise."""
        backend = getattr(tokenizer, "backend", tokenizer)
        try:
            from tokenizers import Tokenizer, decoders
        except ImportError:
            return None
        if not isinstance(backend, Tokenizer) or type(backend.decoder) is not decoders.ByteLevel:
            return None
        return cls(tokenizer, backend)

    def get(self, token_id: int) -> bytes | None:
        table = self._table
        if token_id in table:
            return table[token_id]
        table[token_id] = data = self._bytes(token_id)
        return data

    def _bytes(self, token_id: int) -> bytes | None:
        token = self.backend.id_to_token(token_id)
        if token is None:
            return None
        chars = self._chars
        if all(c in chars for c in token):
            data = bytes(chars[c] for c in token)
        else:
            data = token.encode()
        alone = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return data if data.decode("utf-8", "replace") == alone else None


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas.

    ``window`` holds the recent tokens from the prefix offset on: ``window[:read_offset]``
    are already turned into text (``prefix_text``, their decode), giving the decoder its
    context (leading spaces, merges); tokens from ``read_offset`` on are not emitted yet.
    ``pending``: with ``token_bytes`` and while the byte path holds (``prefix_text`` ends in a
    whole character, no added token in the window), the bytes of the tokens not emitted yet;
    None otherwise.
    """

    def __init__(
        self,
        tokenizer: DecodingTokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_bytes = token_bytes
        self.window = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self.read_offset = len(self.window)
        self.prefix_text = self._decode(self.window)
        self.pending: bytes | None = None
        self._resume_byte_path()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        if self.pending is not None:
            data = self.token_bytes.get(token_id)
            if data is not None:
                return self._append_bytes(token_id, data)
            self.pending = None
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
        self._resume_byte_path()
        return text[num_prefix:]

    def _append_bytes(self, token_id: int, data: bytes) -> str:
        """``append`` on the byte path: the window's text is ``prefix_text`` + the decode of
        ``pending`` (``prefix_text`` ends in a whole character), so no window decode."""
        window = self.window
        window.append(token_id)
        self.pending = pending = self.pending + data
        delta = pending.decode("utf-8", "replace")
        if not delta or delta[-1] == REPLACEMENT_CHAR:
            return ""
        # the window's decode past the offset is the delta (what the plain path computes)
        if len(window) > _MAX_WINDOW_TOKENS:
            del window[: self.read_offset]
            self.prefix_text = delta
        else:
            self.prefix_text += delta
        self.read_offset = len(window)
        self.pending = b""
        return delta

    def _resume_byte_path(self) -> None:
        """Take the byte path from here when the window allows it (see the class docstring)."""
        if self.token_bytes is None or self.prefix_text.endswith(REPLACEMENT_CHAR):
            return
        token_bytes = self.token_bytes
        if all(token_bytes.get(t) is not None for t in self.window):
            self.pending = b""
