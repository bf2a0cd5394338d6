"""The step-cost curve on disk: measured once per GPU, model and configuration, then reused.

A curve is stored as JSON in ``cost_curves/`` under :func:`cache_dir` (``$DEEPINFER_CACHE_DIR``,
else ``$XDG_CACHE_HOME/deepinfer``, else ``~/.cache/deepinfer``), named by the device and a
hash of what the curve depends on (the key, stored in the file as well): the device's name, the
model configuration, the dtype, the draft count, the largest step, the block size, whether
batch-invariant kernels run, whether steps replay graphs (and their largest size) and the
package version. ``DEEPINFER_REMEASURE_STEP_COST=1`` (or ``remeasure=True``, which
``LLM(spec_cost_curve="remeasure")`` sets) measures again and overwrites the file. A file that
does not parse or holds another key is measured over, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.kernels import envs
from deepinfer.spec import StepCostCurve

logger = logging.getLogger("deepinfer.engine")


def cache_dir() -> Path:
    """Where deepinfer keeps measured facts about this machine."""
    if envs.get("DEEPINFER_CACHE_DIR"):
        return Path(envs.get("DEEPINFER_CACHE_DIR"))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "deepinfer"


def curve_key(**facts: Any) -> dict[str, str]:
    """The facts a curve depends on, as strings (the file name is their hash)."""
    return {name: str(value) for name, value in sorted(facts.items())}


def curve_path(key: dict[str, str]) -> Path:
    """The file of ``key``'s curve: ``<device>-<hash of the key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    device = re.sub(r"[^A-Za-z0-9_.]+", "-", key.get("device", "device")).strip("-")
    return cache_dir() / "cost_curves" / f"{device}-{digest}.json"


def cached_step_cost_curve(
    key: dict[str, str], measure: Callable[[], StepCostCurve], *, remeasure: bool = False
) -> StepCostCurve:
    """The curve stored for ``key``, else (or when ``remeasure`` or
    ``DEEPINFER_REMEASURE_STEP_COST`` asks for it) ``measure()``, stored for the next run."""
    path = curve_path(key)
    remeasure = remeasure or envs.get("DEEPINFER_REMEASURE_STEP_COST")
    if path.exists() and not remeasure:
        stored = _read(path, key)
        if stored is not None:
            logger.info("step-cost curve from %s", path)
            return stored
    curve = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "num_tokens": list(curve.num_tokens), "cost": list(curve.cost)}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    logger.info("step-cost curve measured and stored in %s", path)
    return curve


def _read(path: Path, key: dict[str, str]) -> StepCostCurve | None:
    """The curve in ``path`` if it parses and holds ``key``; else None, with a warning."""
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != key:
            logger.warning("step-cost curve %s holds another configuration: measuring again",
                           path)  # fmt: skip
            return None
        return StepCostCurve(tuple(stored["num_tokens"]), tuple(stored["cost"]))
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("step-cost curve %s is unreadable (%s): measuring again", path, error)
        return None
