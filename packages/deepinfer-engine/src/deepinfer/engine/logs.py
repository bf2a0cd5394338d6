"""The level of the ``deepinfer`` loggers, from ``DEEPINFER_LOG_LEVEL``.

Set when an ``LLM`` starts and when the command line runs; handlers stay the application's
choice, so this only decides which records the ``deepinfer`` loggers pass on.
"""

from __future__ import annotations

import logging

from deepinfer.kernels import envs

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def set_log_level() -> int:
    """Apply ``DEEPINFER_LOG_LEVEL`` (default INFO) to the ``deepinfer`` logger; return it."""
    raw = envs.get("DEEPINFER_LOG_LEVEL")
    name = str(raw).strip().upper()
    if name not in LEVELS:
        raise ValueError(f"DEEPINFER_LOG_LEVEL={raw!r}: expected one of {', '.join(LEVELS)}")
    level = getattr(logging, name)
    logging.getLogger("deepinfer").setLevel(level)
    return level
