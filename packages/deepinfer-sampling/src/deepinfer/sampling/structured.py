"""Per-request structured-output state: an xgrammar matcher plus DeepInfer's trigger tokens.

Phases of one request (DeepInfer's semantics):

* ``free`` - before the trigger token sequence appears in the output (matched with KMP over the
  generated tokens) nothing is constrained. With no trigger the request starts in ``grammar``.
* ``forcing`` - the bound token was generated before the trigger completed: the remaining
  trigger tokens are forced one by one (the mask allows only the next one).
* ``grammar`` - the matcher constrains every token until it accepts a stop token.
* ``done`` - the grammar terminated; masks allow everything (the engine stops on EOS).

Every accepted token records the phase before it, so :meth:`rollback` (for rejected draft
tokens) restores the state exactly, including the matcher (``GrammarMatcher.rollback``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from deepinfer.kernels import envs

FREE, FORCING, GRAMMAR, DONE = "free", "forcing", "grammar", "done"


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A host int32 ``[batch, ceil(vocab_size / 32)]`` bitmask, every token allowed."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _kmp_table(pattern: Sequence[int]) -> list[int]:
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


@dataclass(frozen=True)
class _Snapshot:
    """The trigger state before one accepted token, and whether the matcher consumed it."""

    phase: str
    matched: int
    consumed_by_matcher: bool


class StructuredOutputState:
    """Grammar state of one request (one per sequence when ``n > 1``).

    compiled: from :class:`~deepinfer.sampling.compiler.GrammarCompilerService`.
    trigger_token_ids / bound_token_id: see the module docstring.
    max_rollback_tokens: most tokens :meth:`rollback` can undo (default
    ``DEEPINFER_MAX_BACKTRACKING_TOKENS``).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        *,
        trigger_token_ids: Sequence[int] = (),
        bound_token_id: int | None = None,
        max_rollback_tokens: int | None = None,
    ) -> None:
        if max_rollback_tokens is None:
            max_rollback_tokens = envs.get("DEEPINFER_MAX_BACKTRACKING_TOKENS")
        self.max_rollback_tokens = int(max_rollback_tokens)
        # xgrammar >= 0.2.9 keeps unlimited rollback history; our own history bounds rollback.
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self._trigger = tuple(trigger_token_ids)
        self._fail = _kmp_table(self._trigger)
        self._bound = bound_token_id
        self._phase = FREE if self._trigger else GRAMMAR
        self._matched = 0  # trigger tokens matched so far (free) or emitted (forcing)
        self._history: deque[_Snapshot] = deque(maxlen=self.max_rollback_tokens)

    @property
    def phase(self) -> str:
        return self._phase

    def is_terminated(self) -> bool:
        """True once the grammar has accepted its stop token."""
        return self._phase == DONE

    def _advance_trigger(self, token: int) -> None:
        k = self._matched
        while k and token != self._trigger[k]:
            k = self._fail[k - 1]
        if token == self._trigger[k]:
            k += 1
        self._matched = k
        if k == len(self._trigger):
            self._phase = GRAMMAR
        elif token == self._bound:
            self._phase = FORCING

    def accept_token(self, token: int) -> bool:
        """Advance by one generated token; False (state unchanged) if the grammar rejects it."""
        snapshot = _Snapshot(self._phase, self._matched, self._phase == GRAMMAR)
        if self._phase == GRAMMAR:
            if not self._matcher.accept_token(int(token)):
                return False
            if self._matcher.is_terminated():
                self._phase = DONE
        elif self._phase == FORCING:
            if token != self._trigger[self._matched]:
                return False
            self._matched += 1
            if self._matched == len(self._trigger):
                self._phase = GRAMMAR
        elif self._phase == FREE:
            self._advance_trigger(int(token))
        self._history.append(snapshot)
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted."""
        for i, token in enumerate(tokens):
            if not self.accept_token(token):
                return i
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most ``max_rollback_tokens``)."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(
                f"rollback(num_tokens={num_tokens}): expected 0..{len(self._history)} "
                f"(tokens accepted within the last max_rollback_tokens={self.max_rollback_tokens})"
            )
        if num_tokens == 0:
            return
        undone = [self._history.pop() for _ in range(num_tokens)]
        matcher_tokens = sum(s.consumed_by_matcher for s in undone)
        if matcher_tokens:
            self._matcher.rollback(matcher_tokens)
        earliest = undone[-1]
        self._phase, self._matched = earliest.phase, earliest.matched

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]``; True if the row is constrained.

        bitmask: host int32 ``[B, ceil(V / 32)]`` (:func:`allocate_token_bitmask`).
        """
        if self._phase in (FREE, DONE):
            bitmask[row].fill_(-1)
            return False
        if self._phase == FORCING:
            token = self._trigger[self._matched]
            bitmask[row].zero_()
            word, bit = divmod(token, 32)
            bitmask[row, word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            return True
        self._matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_draft_bitmasks(
        self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int]
    ) -> int:
        """Masks for a verification window: row ``first_row + i`` gets the mask after drafts
        ``0..i-1``. Stops at the first draft the grammar rejects (its later rows are left
        as they are) and rolls the tentative accepts back. Returns the number of rows filled."""
        self.fill_bitmask(bitmask, first_row)
        accepted = 0
        for i, token in enumerate(draft_token_ids):
            if not self.accept_token(token):
                break
            accepted += 1
            self.fill_bitmask(bitmask, first_row + i + 1)
        self.rollback(accepted)
        return accepted + 1


def fill_bitmasks(
    states: Sequence[StructuredOutputState],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    *,
    batch_matcher: xgr.BatchGrammarMatcher | None = None,
) -> None:
    """``states[i].fill_bitmask(bitmask, rows[i])`` for every i, with the grammar-phase rows
    filled together by xgrammar's multithreaded ``BatchGrammarMatcher`` (pass one to reuse its
    threads; by default one is made per call)."""
    if len(states) != len(rows):
        raise ValueError(f"fill_bitmasks: {len(states)} states for {len(rows)} rows")
    grammar_rows, matchers = [], []
    for state, row in zip(states, rows):
        if state.phase == GRAMMAR:
            grammar_rows.append(int(row))
            matchers.append(state._matcher)
        else:
            state.fill_bitmask(bitmask, row)
    if matchers:
        batch_matcher = batch_matcher if batch_matcher is not None else xgr.BatchGrammarMatcher()
        batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=grammar_rows)


__all__ = [
    "DONE",
    "FORCING",
    "FREE",
    "GRAMMAR",
    "StructuredOutputState",
    "allocate_token_bitmask",
    "fill_bitmasks",
]
