"""Draft proposal for speculative decoding: what the runner asks of a draft source, and the
DSpark source over the checkpoint's draft stages.

Each step the runner (1) hands the draft source the target forward's output so it can seed its
windows with every processed token (prefill chunks and verify rows included: rows of rejected
tokens sit at positions that are rewritten before they are read again, since every ring holds
``window + K`` rows), then (2) asks for drafts after each request's newest token.

A draft at block index ``i`` is the token for position ``last_position + 2 + i``. It is picked
from the drafter's Markov-corrected logits by the request's own sampling pipeline (penalties,
bias, grammar mask, temperature, top-k/p/min-p), with the grammar matcher advanced over the
earlier drafts (and rolled back afterwards): greedy requests take the argmax, seed-exact
requests draw with the target's own RNG key (seed, position, ``STREAM_SAMPLE``), rejection
requests draw from the processed draft distribution ``q`` on ``STREAM_DRAFT`` and keep ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.mtp import DraftProposal
from deepinfer.engine.model.mtp_heads import confidence_from_logits
from deepinfer.engine.runner.async_step import device_index, sync_guard
from deepinfer.engine.runner.draft_graphs import DraftGraphs
from deepinfer.engine.runner.spec_sampling import processed_probs
from deepinfer.engine.runner.speculation import REJECTION
from deepinfer.sampling import allocate_token_bitmask, rng, sample
from deepinfer.spec import draw_categorical


@dataclass
class DraftRequest:
    """One request to draft for.

    anchor: the token the step just produced (at ``last_position + 1``); last_position: the
    newest position the target processed and kept; slot: its state slot; params: sampling
    parameters with ``seq_seed`` set; mode: ``greedy | seed_exact | rejection``; history: its
    generated tokens, the anchor included (empty when ``params`` has no penalties or bans:
    nothing else reads it); max_drafts: drafts wanted (<= K); grammar: its
    ``StructuredOutputState`` or None; pending_tokens: tokens of this step not yet fed to the
    grammar matcher (the anchor among them).
    """

    request_id: str
    anchor: int
    last_position: int
    slot: int
    params: Any
    mode: str
    history: list[int]
    max_drafts: int
    grammar: Any = None
    pending_tokens: list[int] = field(default_factory=list)


@dataclass
class Proposal:
    """A request's drafts: tokens, the confidence of each (``sigmoid(logit / T)`` of the
    confidence head, ``T`` the checkpoint's ``dspark_confidence_temperature``: acceptance
    probability given the earlier drafts were accepted) and, for rejection
    requests, the processed distributions ``[n, V]`` fp32 they were drawn from."""

    tokens: list[int]
    confidences: list[float]
    probs: torch.Tensor | None = None


class DraftSource(Protocol):
    """What the runner needs from a drafter (the DSpark stages, or a test oracle)."""

    num_draft_tokens: int

    def seed(self, step: Any, batch: ForwardBatch) -> None: ...

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]: ...


class DSparkDraftSource:
    """The checkpoint's DSpark stages (``model.mtp``) driven over ``cache``."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: ModelCache,
        num_draft_tokens: int,
        graphs: DraftGraphs | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.num_draft_tokens = num_draft_tokens
        self.graphs = graphs  # the stages of a proposal as one graph replay, when given
        self.confidence_temperature = float(model.config.dspark_confidence_temperature)
        if not self.confidence_temperature > 0:
            raise ValueError(
                f"dspark_confidence_temperature={self.confidence_temperature} in the "
                "checkpoint's config.json: expected a number > 0"
            )

    def seed(self, step: Any, batch: ForwardBatch) -> None:
        """Write every stage's window rows of the step's tokens from the taps ``step.taps``
        (those of ``step.rows`` when YoCo truncation computed only them)."""
        counts = batch.cu_seqlens_q.diff().long()
        # output_size: no device-to-host read of the total
        token_slots = batch.state_slots.long().repeat_interleave(
            counts, output_size=batch.positions.shape[0]
        )
        positions = batch.positions
        if step.rows is not None:
            positions, token_slots = positions[step.rows], token_slots[step.rows]
        self.model.mtp.seed(step.taps, positions, token_slots, self.cache, self.model.rope)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        if not requests:
            return {}
        # every pick an argmax: a graph runs the Markov head and the picks as well
        greedy = all(r.grammar is None and r.params.is_plain_greedy for r in requests)
        block = self._block_graph(requests, greedy)
        picker = DraftPicker(requests, self.num_draft_tokens)
        try:
            if block is not None and greedy:
                drafts, confidence_logits = block
            else:
                drafted = self._drafted(requests, block, picker)
                drafts, confidence_logits = drafted.tokens, drafted.confidence_logits
        finally:
            picker.release_grammars()
        temperature = self.confidence_temperature
        confidences = confidence_from_logits(confidence_logits, temperature).tolist()
        tokens = drafts.tolist()
        return {
            r.request_id: Proposal(
                tokens[b][: picker.limits[b]],
                confidences[b][: picker.limits[b]],
                picker.draft_probs(b),
            )
            for b, r in enumerate(requests)
        }

    def chains(self, num_requests: int) -> bool:
        """Whether a proposal of ``num_requests`` plain greedy requests can take its anchors
        from the device (:meth:`propose_on_device`): a greedy draft graph of that size."""
        return self.graphs is not None and self.graphs.key(num_requests, True) is not None

    @torch.inference_mode()
    def propose_on_device(
        self, anchors: torch.Tensor, last_positions: torch.Tensor, slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts ``[B, K]`` and their confidences ``[B, K]`` fp32 on the device for plain
        greedy requests whose anchors and last positions are ``[B]`` device tensors (the
        verification step's outcome), queued without reading anything back; None when the
        graph could not be captured (the caller then proposes from the host)."""
        replays = self.graphs.replays(len(slots), True)
        with sync_guard(self.model.embed.weight.device, replays):
            block = self.graphs.run_on_device(anchors, last_positions, slots, True)
            if block is None:
                return None
            drafts, confidence_logits = block
            return drafts, confidence_from_logits(confidence_logits, self.confidence_temperature)

    def _drafted(self, requests: list[DraftRequest], block, picker: DraftPicker) -> DraftProposal:
        """Drafts picked by ``picker`` from the graph's ``block`` (hidden, base logits,
        anchors), or from an eager proposal when there is none."""
        if block is not None:
            return self.model.mtp.markov_decode(*block, self.num_draft_tokens, picker)
        long = dict(dtype=torch.long, device=self.model.embed.weight.device)
        return self.model.mtp.propose(
            torch.tensor([r.anchor for r in requests], **long),
            torch.tensor([r.last_position for r in requests], **long),
            torch.tensor([r.slot for r in requests], **long),
            self.cache,
            self.model.embed,
            self.model.head.weight,
            self.model.rope,
            block_size=self.num_draft_tokens,
            sample=picker,
        )

    def _block_graph(self, requests: list[DraftRequest], greedy: bool):
        """The draft block from a graph (:meth:`DraftGraphs.run`), or None."""
        if self.graphs is None:
            return None
        replays = self.graphs.replays(len(requests), greedy)
        with sync_guard(self.model.embed.weight.device, replays):
            return self.graphs.run([r.anchor for r in requests],
                                   [r.last_position for r in requests],
                                   [r.slot for r in requests], greedy)  # fmt: skip


class DraftPicker:
    """The ``sample(logits [B, V], index) -> [B]`` callback of ``DSparkDraft.propose``: picks
    each request's draft through its sampling pipeline (see the module docstring) and keeps
    the grammar matchers in step. ``limits[b]``: how many of request ``b``'s drafts count."""

    def __init__(self, requests: list[DraftRequest], num_draft_tokens: int) -> None:
        self.requests = requests
        self.limits = [min(r.max_drafts, num_draft_tokens) for r in requests]
        self.picked: list[list[int]] = [[] for _ in requests]
        self._probs: list[list[torch.Tensor]] = [[] for _ in requests]
        self._advanced = [0] * len(requests)
        self._pending_fed = [0] * len(requests)
        for b, r in enumerate(requests):
            if r.grammar is None:
                continue
            fed = r.grammar.accept_tokens(r.pending_tokens)
            self._pending_fed[b] = fed
            if fed < len(r.pending_tokens):
                self.limits[b] = 0  # the matcher refused this step's tokens: no drafts
        # grammar matchers, penalties and token bans read the earlier drafts on the host;
        # otherwise the picks stay on the device until the proposal's one read
        self.host_picks = any(r.grammar is not None or r.params.has_penalty
                              or r.params.has_bans for r in requests)  # fmt: skip

    def __call__(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        reqs = self.requests
        positions = [r.last_position + 2 + index for r in reqs]
        histories = [r.history + self.picked[b] for b, r in enumerate(reqs)]
        bitmask = self._bitmask(index, logits.shape[1])
        match = [b for b, r in enumerate(reqs) if r.mode != REJECTION]
        reject = [b for b, r in enumerate(reqs) if r.mode == REJECTION]
        if not reject:
            tokens = self._draw_match(logits, match, positions, histories, bitmask)
        elif not match:
            tokens = self._draw_rejection(logits, reject, positions, histories, bitmask)
        else:
            tokens = torch.zeros(len(reqs), dtype=torch.long, device=logits.device)
            tokens[match] = self._draw_match(logits, match, positions, histories, bitmask)
            tokens[reject] = self._draw_rejection(logits, reject, positions, histories, bitmask)
        if self.host_picks:
            self._record(tokens.tolist(), index)
        return tokens

    def _bitmask(self, index: int, vocab_size: int) -> torch.Tensor | None:
        rows = [b for b, r in enumerate(self.requests) if r.grammar is not None]
        if not rows:
            return None
        mask = allocate_token_bitmask(len(self.requests), vocab_size)
        for b in rows:
            if index < self.limits[b]:
                self.requests[b].grammar.fill_bitmask(mask, b)
        return mask

    def _draw_match(self, logits, rows, positions, histories, bitmask) -> torch.Tensor:
        result = sample(
            _take(logits, rows),
            [self.requests[b].params for b in rows],
            [positions[b] for b in rows],
            output_token_ids=[histories[b] for b in rows],
            bitmask=None if bitmask is None else bitmask[rows],
            stream=rng.STREAM_SAMPLE,
        )
        return result.token_ids

    def _draw_rejection(self, logits, rows, positions, histories, bitmask) -> torch.Tensor:
        probs = processed_probs(
            _take(logits, rows),
            [self.requests[b].params for b in rows],
            [histories[b] for b in rows],
            None if bitmask is None else bitmask[rows],
        )
        seeds = device_index([self.requests[b].params.seq_seed for b in rows], logits.device)
        where = device_index([positions[b] for b in rows], logits.device)
        drawn = draw_categorical(probs, seeds, where, rng.STREAM_DRAFT)
        for i, b in enumerate(rows):
            self._probs[b].append(probs[i])
        return drawn

    def _record(self, tokens: list[int], index: int) -> None:
        for b, r in enumerate(self.requests):
            self.picked[b].append(tokens[b])
            if r.grammar is None or index >= self.limits[b]:
                continue
            if r.grammar.accept_token(tokens[b]):
                self._advanced[b] += 1
            else:
                self.limits[b] = index  # not a valid continuation: drop it and what follows

    def release_grammars(self) -> None:
        """Roll every matcher back to where it was before drafting."""
        for b, r in enumerate(self.requests):
            if r.grammar is not None:
                r.grammar.rollback(self._advanced[b] + self._pending_fed[b])
                self._advanced[b] = self._pending_fed[b] = 0

    def draft_probs(self, b: int) -> torch.Tensor | None:
        """``[limits[b], V]`` processed draft distributions of a rejection request."""
        if not self._probs[b]:
            return None
        return torch.stack(self._probs[b][: self.limits[b]])


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``; every row as is (indexing with a list copies it from the host)."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def draft_params(seq) -> Any:
    """The parameters a sequence's drafts are picked with, built once per sequence: its own
    with its seed, and no logprobs (a pick needs none: plain greedy requests then pick in the
    draft graph)."""
    if seq.draft_params is None:
        seq.draft_params = replace(seq.sampling_params, seq_seed=seq.seed, seed=None,
                                   logprobs=None)  # fmt: skip
    return seq.draft_params
