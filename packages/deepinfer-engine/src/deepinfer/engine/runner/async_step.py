"""A launched step whose sampled tokens are read back later (asynchronous scheduling).

The runner queues a step's forward and sampling on the device, starts copying the sampled
tokens to pinned host memory, and returns a :class:`PendingStep`; the host then schedules and
prepares the next step while the device works. ``result()`` waits for the copy (the one
device-to-host read of the step) and builds the ``ModelRunnerOutput``. :func:`sync_guard`
(``DEEPINFER_SYNC_GUARD=1``) makes any other host synchronisation in such a step raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from deepinfer.engine.core.scheduler_output import ModelRunnerOutput


@contextlib.contextmanager
def sync_guard(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """With ``DEEPINFER_SYNC_GUARD=1`` on CUDA (and ``enabled``), any host synchronisation
    inside raises (``torch.cuda.set_sync_debug_mode("error")``): the runner wraps the forward
    and sampling launch of plain steps that replay a captured decode graph, which must only
    queue device work."""
    from deepinfer.kernels import envs

    if not enabled or device.type != "cuda" or not envs.get("DEEPINFER_SYNC_GUARD"):
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def read_back(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
    """Start copying ``tensors`` to host memory without waiting: (the host tensors, the event
    that marks the copies done, None off CUDA where the tensors already are on the host)."""
    if tensors[0].device.type != "cuda":
        return tuple(t.cpu() for t in tensors), None
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record()
    return tuple(hosts), event


def device_index(rows: list[int], device) -> torch.Tensor:
    """``rows`` as an index tensor on ``device``, queued without a host sync (a blocking copy
    from pageable memory, as ``torch.tensor(rows, device=...)`` makes, waits for the device)."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``: ``x`` itself when ``rows`` are all its rows in order (the usual case: no
    index to copy and gather with), else gathered through :func:`device_index`."""
    if rows == list(range(x.shape[0])):
        return x
    return x[device_index(rows, x.device)]


class PendingStep:
    """A step in flight; ``finish(*host tensors as lists)`` builds its output, once.

    tokens / rows: a plain step's sampled tokens on the device and, per request that sampled
    one token, its index there: the next step may take them as input without waiting
    (``placeholders``: where the runner's token lists hold such a token for now, request ->
    index, set right by ``finish``)."""

    def __init__(
        self,
        finish: Callable[..., ModelRunnerOutput],
        host: tuple[torch.Tensor, ...],
        event: torch.cuda.Event | None,
        *,
        tokens: torch.Tensor | None = None,
        rows: dict[str, int] | None = None,
    ) -> None:
        self._finish = finish
        self._host = host
        self._event = event
        self._output: ModelRunnerOutput | None = None
        self.tokens, self.rows = tokens, rows
        self.placeholders: dict[str, int] = {}

    @property
    def is_done(self) -> bool:
        return self._output is not None

    def feeds(self, request_ids, sequences, grammar) -> bool:
        """Whether the next step may take this step's tokens as input on the device without
        waiting: each of its placeholder requests ``request_ids`` sampled one token here
        (no fork) and reads no history on the host (penalties, bans, a grammar)."""
        if self.rows is None:
            return False
        for request_id in request_ids:
            seq = sequences.get(request_id)
            if request_id not in self.rows or seq is None:
                return False
            params = seq.sampling_params
            if params.has_penalty or params.has_bans:
                return False
            if grammar is not None and grammar.has_grammar(request_id):
                return False
        return True

    def hold_placeholders(self, request_ids, sequences) -> None:
        """Note the token index where each of ``request_ids`` holds this step's token as a
        placeholder (its newest), set right by ``finish``."""
        for request_id in request_ids:
            self.placeholders[request_id] = len(sequences[request_id].token_ids) - 1

    def fed_inputs(self, plan, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input rows, tokens) on ``device``: each placeholder the next step's ``plan`` takes
        as input (a request's last row), with the token this step sampled for it; or None."""
        if not self.placeholders:
            return None
        rows, picks = [], []
        for b, request_id in enumerate(plan.request_ids):
            at = self.placeholders.get(request_id)
            last = plan.cu_seqlens_q[b + 1] - 1
            if at is not None and plan.positions[last] == at:
                rows.append(last)
                picks.append(self.rows[request_id])
        if not rows:
            return None
        index = device_index(rows + picks, device)
        return index[: len(rows)], self.tokens[index[len(rows) :]]

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._finish(*(h.tolist() for h in self._host))
        return self._output
