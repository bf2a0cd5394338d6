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


def read_back(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``tokens`` to host memory without waiting: (host tensor, the event that
    marks the copy done, None off CUDA where the tensor already is on the host)."""
    if tokens.device.type != "cuda":
        return tokens.cpu(), None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


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
    """A step in flight; ``finish(host tokens as a list)`` builds its output, once."""

    def __init__(
        self,
        finish: Callable[[list[int]], ModelRunnerOutput],
        host_tokens: torch.Tensor,
        event: torch.cuda.Event | None,
    ) -> None:
        self._finish = finish
        self._host_tokens = host_tokens
        self._event = event
        self._output: ModelRunnerOutput | None = None

    @property
    def is_done(self) -> bool:
        return self._output is not None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._finish(self._host_tokens.tolist())
        return self._output
