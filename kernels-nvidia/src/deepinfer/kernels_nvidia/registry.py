"""Where kernel modules record which op of ``deepinfer.kernels`` they implement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}


def implements(op_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op_name in IMPLEMENTATIONS:
            raise RuntimeError(f"two NVIDIA kernels claim op {op_name!r}")
        IMPLEMENTATIONS[op_name] = fn
        return fn

    return wrap
