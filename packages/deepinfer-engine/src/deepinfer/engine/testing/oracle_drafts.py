"""Test doubles for speculative decoding: an oracle draft source and its expected counts.

:class:`OracleDraftSource` proposes, for each request, the tokens a reference run produced at
the drafted positions, with chosen positions corrupted (token + 1). Plugged into a runner in
place of the DSpark stages it makes long accepted runs, rejections at every draft index and the
rollbacks after them happen where a test says, so exactness and exact accept counts can be
checked (:func:`expected_oracle_counts` replays the runner's drafting rule on plain lists).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.engine.runner.drafting import DraftRequest, Proposal


@dataclass
class OracleDraftSource:
    """reference: ``{request id: prompt + reference output tokens}``; is_corrupt(request id,
    absolute position) marks drafts to spoil; confidence(draft index) the reported confidence.
    """

    reference: dict[str, list[int]]
    num_draft_tokens: int
    vocab_size: int
    is_corrupt: Callable[[str, int], bool]
    confidence: Callable[[int], float] = lambda index: 0.9

    def seed(self, step, batch) -> None:
        """Nothing to seed: the oracle reads no hidden states."""

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        proposals = {}
        for r in requests:
            full = self.reference[r.request_id]
            tokens = []
            for i in range(min(r.max_drafts, self.num_draft_tokens)):
                position = r.last_position + 2 + i
                if position >= len(full):
                    break
                token = full[position]
                if self.is_corrupt(r.request_id, position):
                    token = (token + 1) % self.vocab_size
                tokens.append(token)
            confidences = [self.confidence(i) for i in range(len(tokens))]
            proposals[r.request_id] = Proposal(tokens, confidences)
        return proposals


@dataclass(frozen=True)
class OracleCounts:
    """What a request run with the oracle reports: drafts verified, accepted, verify steps."""

    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    num_plain_steps: int  # steps that sampled one token without drafts (the prefill's too)
    rejected_at: frozenset[int]  # draft indices where a rejection happened
    num_full_accepts: int  # verify steps that accepted every draft


def expected_oracle_counts(
    num_prompt_tokens: int,
    max_tokens: int,
    num_draft_tokens: int,
    is_corrupt: Callable[[int], bool],
) -> OracleCounts:
    """Replay fixed-length verification with oracle drafts for one request that generates
    exactly ``max_tokens`` tokens (no stop): the first token comes from the prefill; after
    each step the runner drafts ``min(K, max_tokens - generated - 1)`` tokens; a verify step
    accepts the drafts before the first corrupted one and emits them plus one token.
    ``is_corrupt(absolute position)``."""
    generated, drafts, accepted, steps, full, plain = 1, 0, 0, 0, 0, 1
    rejected_at: set[int] = set()
    while generated < max_tokens:
        n = min(num_draft_tokens, max_tokens - generated - 1)
        if n <= 0:
            generated, plain = generated + 1, plain + 1  # a plain decode step
            continue
        first = num_prompt_tokens + generated
        a = 0
        while a < n and not is_corrupt(first + a):
            a += 1
        if a < n:
            rejected_at.add(a)
        else:
            full += 1
        drafts, accepted, steps, generated = drafts + n, accepted + a, steps + 1, generated + a + 1
    return OracleCounts(drafts, accepted, steps, plain, frozenset(rejected_at), full)
