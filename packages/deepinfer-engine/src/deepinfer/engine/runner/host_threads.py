"""Torch's CPU threads in an engine whose model runs on an accelerator.

There the host's torch work is small (a step's index lists: gathers and scans of a few thousand
integers), and torch's intra-op pool gains nothing on it. It can cost: after each parallel
region the pool's threads spin for a while, and where they outnumber the cores the process may
use (a container's CPU quota), the main thread that builds and launches the step waits behind
them, and a prefill step's index lists then take many times their CPU time (measured in
`benchmarks/RESULTS.md`, "Where a prefill step's host time goes"). So, as vLLM does in its GPU
workers, the engine runs torch's CPU ops on one thread there, unless ``OMP_NUM_THREADS`` is set
(then the user's choice stands). A CPU model keeps every thread: its layers run on them.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("deepinfer.engine")


def limit_host_threads(device: torch.device, environ: dict[str, str] | None = None) -> int:
    """One torch CPU thread when the model runs on an accelerator and ``OMP_NUM_THREADS`` is
    unset; returns the thread count torch uses after the call."""
    environ = os.environ if environ is None else environ
    current = torch.get_num_threads()
    if device.type == "cpu" or "OMP_NUM_THREADS" in environ or current == 1:
        return current
    torch.set_num_threads(1)
    logger.info(
        "torch CPU threads: %d -> 1 (the model runs on %s; set OMP_NUM_THREADS to choose)",
        current,
        device.type,
    )
    return 1
