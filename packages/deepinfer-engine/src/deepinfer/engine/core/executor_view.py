"""What the executor already knows of each sequence, so each step sends only diffs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler_output import CachedRequestData, NewRequestData


@dataclass(slots=True)
class _Known:
    num_tokens: int
    num_blocks: int


@dataclass
class ExecutorView:
    """Per request id: how many tokens and block-table entries the executor holds.

    ``forget`` records the id as finished or preempted so the next ``SchedulerOutput`` tells
    the executor to drop it.
    """

    _known: dict[str, _Known] = field(default_factory=dict)
    finished_ids: set[str] = field(default_factory=set)
    preempted_ids: set[str] = field(default_factory=set)

    def describe(
        self, request: Request, replaced: Sequence[tuple[int, int]]
    ) -> NewRequestData | CachedRequestData:
        """The diff for a scheduled request; marks it as known up to its current state.

        Tokens still to come from a step in flight (``num_placeholders``) count as known: the
        executor appends them itself (``SchedulerOutput.from_previous_sample``).
        """
        known = self._known.get(request.request_id)
        num_tokens = request.num_tokens + request.num_placeholders
        if known is None:
            assert request.state_slot is not None and not request.num_placeholders
            self._known[request.request_id] = _Known(num_tokens, len(request.block_ids))
            return NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params,
                seed=request.seed,
                block_ids=list(request.block_ids),
                state_slot=request.state_slot,
                has_user_seed=request.has_user_seed,
                images=request.images,
            )
        num_known_blocks = known.num_blocks
        data = CachedRequestData(
            request_id=request.request_id,
            new_token_ids=request.all_token_ids[known.num_tokens :],
            new_block_ids=request.block_ids[num_known_blocks:],
            replaced_block_ids=[(i, b) for i, b in replaced if i < num_known_blocks],
            num_computed_tokens=request.num_computed_tokens,
        )
        known.num_tokens, known.num_blocks = num_tokens, len(request.block_ids)
        return data

    def forget(self, request_id: str, *, preempted: bool) -> None:
        if self._known.pop(request_id, None) is None:
            return
        (self.preempted_ids if preempted else self.finished_ids).add(request_id)

    def take_forgotten(self) -> tuple[set[str], set[str]]:
        """(finished ids, preempted ids) recorded since the last call."""
        finished, preempted = self.finished_ids, self.preempted_ids
        self.finished_ids, self.preempted_ids = set(), set()
        return finished, preempted
