"""A launched step whose sampled tokens are read back later (asynchronous scheduling).

The runner queues a step's forward and sampling on the device, starts copying the sampled
tokens to pinned host memory, and returns a :class:`PendingStep`; the host then schedules and
prepares the next step while the device works. ``result()`` waits for the copy (the one
device-to-host read of the step) and builds the ``ModelRunnerOutput``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.engine.core.scheduler_output import ModelRunnerOutput


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
