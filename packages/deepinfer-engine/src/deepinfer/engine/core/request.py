"""A request as the scheduler sees it: one sequence of tokens chasing its computation.

A user request with ``n > 1`` samples is one *group*: its prompt is scheduled once as the
sequence whose ``request_id`` is the group id; when the prompt is computed the sequence forks
into ``n`` sequences (index 0 keeps the id, index ``k`` is ``"<group id>#<k>"``). Plain data, no
tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.core.text_buffer import TextBuffer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)

_MASK63 = (1 << 63) - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StopConditions:
    """What ends a sequence, read once from its sampling parameters.

    ``min_tokens`` suppresses every stop but the length limits until that many tokens exist;
    ``first_n_token_no_eos`` suppresses EOS only, for the first n generated tokens.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    first_n_token_no_eos: int = 0
    include_stop_str_in_output: bool = False

    @classmethod
    def from_sampling_params(cls, params: Any) -> StopConditions:
        """Build from any object with SamplingParams' field names (missing fields: defaults)."""
        stop = getattr(params, "stop", None) or ()
        if isinstance(stop, str):
            stop = (stop,)
        return cls(
            max_tokens=int(getattr(params, "max_tokens", 16) or 16),
            min_tokens=int(getattr(params, "min_tokens", 0) or 0),
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(getattr(params, "stop_token_ids", None) or ()),
            ignore_eos=bool(getattr(params, "ignore_eos", False)),
            first_n_token_no_eos=int(getattr(params, "first_n_token_no_eos", 0) or 0),
            include_stop_str_in_output=bool(getattr(params, "include_stop_str_in_output", False)),
        )

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def num_samples(params: Any) -> int:
    """The ``n`` of the sampling parameters (1 when absent)."""
    return int(getattr(params, "n", 1) or 1)


def child_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a group: the group's seed for 0, a mix of it otherwise.

    SplitMix64's finaliser over (seed, index), kept to 63 bits so it fits a signed int64.
    """
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


class Request:
    """One sequence: prompt, generated tokens, cache resources and stop state.

    Token bookkeeping: ``all_token_ids`` = prompt + outputs; ``num_computed_tokens`` counts
    positions whose KV/state the model has written (chases ``num_tokens``). ``spec_token_ids``
    are draft tokens to verify next step (speculative decoding; empty otherwise).
    ``has_user_seed``: whether the user gave the seed (seeded sampling verifies drafts
    seed-exactly; engine-drawn seeds use rejection sampling, see the runner's speculation).

    Steps in flight (scheduled, results not yet applied; asynchronous scheduling keeps one):
    ``num_placeholders`` counts tokens such steps will sample that ``all_token_ids`` does not
    hold yet (the executor feeds each into the next step itself); ``awaits_result`` is set
    when the step in flight decides the next input in a way only its result tells (drafts
    verified, a fork); ``speculates`` once the executor returned drafts for the request, whose
    next input then depends on how many get accepted.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        *,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        group_id: str | None = None,
        index: int = 0,
        skip_special_tokens: bool = True,
        has_user_seed: bool = True,
    ) -> None:
        self.request_id = request_id
        self.has_user_seed = has_user_seed  # False: the engine drew the seed (speculation mode)
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.sampling_params = sampling_params
        self.stop_conditions = StopConditions.from_sampling_params(sampling_params)
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] = []
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_placeholders = 0
        self.awaits_result = False
        self.speculates = False
        self.block_ids: list[int] = []
        self.state_slot: int | None = None
        self.reserved_child_slots: list[int] = []
        self.num_pending_samples = num_samples(sampling_params) if index == 0 else 1
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.skip_special_tokens = skip_special_tokens  # False when the text will be parsed
        self.detokenizer: Any = None  # IncrementalDetokenizer when a tokenizer is known
        self.text = TextBuffer()
        # V4.1 images (frontend ImageInput objects: the scheduler reads .offset, .num_tokens)
        self.images: tuple[Any, ...] = ()

    @property
    def output_text(self) -> str:
        """The generated text so far (cut at a matched stop string)."""
        return self.text.text()

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def forks_on_prompt_end(self) -> bool:
        """True while the prompt is still to be computed once for ``n > 1`` samples."""
        return self.num_pending_samples > 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


def request_seeds(request: Request) -> list[int]:
    """The seeds of the ``n`` samples a forking request's last prompt row is drawn with."""
    return [child_seed(request.seed, k) for k in range(request.num_pending_samples)]
