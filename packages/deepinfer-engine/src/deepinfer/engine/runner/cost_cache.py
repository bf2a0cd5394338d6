"""The step-cost curve on disk: measured once per GPU, model and configuration, then reused.

A curve is stored as JSON under ``$DEEPINFER_CACHE_DIR/step_cost/`` (default
``~/.cache/deepinfer``), named by a hash of what it depends on: the device's name, the model
configuration, the dtype, the draft count, the largest step, the block size, whether
batch-invariant kernels run, and the package version. ``DEEPINFER_REMEASURE_STEP_COST=1``
measures again and overwrites the file. A file that does not parse is measured over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.kernels import envs
from deepinfer.spec import StepCostCurve

logger = logging.getLogger("deepinfer.engine")


def cache_dir() -> Path:
    """Where deepinfer keeps measured facts about this machine."""
    return Path(envs.get("DEEPINFER_CACHE_DIR") or Path.home() / ".cache" / "deepinfer")


def curve_key(**facts: Any) -> dict[str, str]:
    """The facts a curve depends on, as strings (the file name is their hash)."""
    return {name: str(value) for name, value in sorted(facts.items())}


def cached_step_cost_curve(
    key: dict[str, str], measure: Callable[[], StepCostCurve]
) -> StepCostCurve:
    """The curve stored for ``key``, else (or when re-measuring is asked for) ``measure()``,
    stored for the next run."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "step_cost" / f"{digest}.json"
    if path.exists() and not envs.get("DEEPINFER_REMEASURE_STEP_COST"):
        try:
            stored = json.loads(path.read_text())
            if stored["key"] == key:
                logger.info("step-cost curve from %s", path)
                return StepCostCurve(tuple(stored["num_tokens"]), tuple(stored["cost"]))
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("step-cost curve %s unreadable (%s): measuring again", path, error)
    curve = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "num_tokens": list(curve.num_tokens), "cost": list(curve.cost)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    logger.info("step-cost curve stored in %s", path)
    return curve
