"""Structured outputs inside the runner: one grammar compiler per tokenizer, one matcher per
sequence, masks for the rows being sampled.

Compilation starts when a request is registered (in xgrammar's thread pool, with the
``DEEPINFER_XGRAMMAR_TIMEOUT`` deadline) and overlaps its prefill; the runner waits for it only
when the request first samples. A schema that does not compile, or a compile that times out,
fails that request alone.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.tokenizer.tokenizer import byte_level_decoder
from deepinfer.sampling import GrammarCompilerService, StructuredOutputState, allocate_token_bitmask


def tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    """An ``xgrammar.TokenizerInfo`` from our byte-level BPE tokenizer, without transformers.

    Every regular token is given as its raw bytes; added (special) tokens as empty strings,
    which xgrammar never allows inside a grammar. Ids past the tokenizer (a padded logits
    width) are empty too. EOS is the stop token.
    """
    import xgrammar as xgr

    decoder = byte_level_decoder()
    special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}
    vocab: list[bytes] = []
    for token_id in range(vocab_size):
        token = tokenizer.id_to_token(token_id)
        if token is None or token in special:
            vocab.append(b"")
            continue
        try:
            vocab.append(bytes(decoder[ch] for ch in token))
        except KeyError:
            vocab.append(token.encode("utf-8"))
    return xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )


class GrammarManager:
    """The structured-output state of every sequence the runner holds, by request id."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._service: GrammarCompilerService | None = None
        self._pending: dict[str, Any] = {}  # PendingGrammar while compiling
        self._states: dict[str, StructuredOutputState] = {}
        self._specs: dict[str, Any] = {}

    @property
    def service(self) -> GrammarCompilerService:
        if self._service is None:
            self._service = GrammarCompilerService(tokenizer_info(self.tokenizer, self.vocab_size))
        return self._service

    def start(self, request_id: str, params: Any, generated: list[int], errors: dict[str, str]):
        """Start compiling the request's grammar; replay tokens it already generated (a
        resumed or forked sequence)."""
        spec = getattr(params, "grammar_spec", None)
        if spec is None:
            return
        self._specs[request_id] = spec
        self._pending[request_id] = self.service.submit(spec)
        if generated and self.ready(request_id, errors):
            self.advance(request_id, generated, errors)

    def ready(self, request_id: str, errors: dict[str, str]) -> bool:
        """Make sure the matcher exists (waiting for the compile); False, with an error for the
        request, if the grammar is invalid or its compile timed out."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return request_id not in errors
        try:
            compiled = pending.wait()
        except Exception as e:  # the compiler's message, for this request only
            errors[request_id] = str(e)
            return False
        spec = self._specs[request_id]
        self._states[request_id] = StructuredOutputState(
            compiled, trigger_token_ids=spec.trigger_token_ids, bound_token_id=spec.bound_token_id
        )
        return True

    def advance(self, request_id: str, tokens: list[int], errors: dict[str, str]) -> None:
        state = self._states.get(request_id)
        if state is None or not tokens:
            return
        for token in tokens:
            if state.is_terminated():
                return
            if not state.accept_token(token):
                errors[request_id] = f"token {token} was rejected by the structured-output grammar"
                return

    def has_grammar(self, request_id: str) -> bool:
        """Whether the request decodes under a grammar (compiled or not yet)."""
        return request_id in self._specs

    def state(self, request_id: str) -> StructuredOutputState | None:
        """The request's matcher state (None without a grammar or before it compiled)."""
        return self._states.get(request_id)

    def bitmask_row(self, request_id: str) -> torch.Tensor | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        mask = allocate_token_bitmask(1, self.vocab_size)
        state.fill_bitmask(mask, 0)
        return mask[0]

    def stack(self, rows: list[torch.Tensor | None]) -> torch.Tensor:
        mask = allocate_token_bitmask(len(rows), self.vocab_size)
        for i, row in enumerate(rows):
            if row is not None:
                mask[i] = row
        return mask

    def forget(self, request_id: str) -> None:
        for table in (self._pending, self._states, self._specs):
            table.pop(request_id, None)
