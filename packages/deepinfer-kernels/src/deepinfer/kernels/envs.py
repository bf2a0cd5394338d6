"""The one typed registry of ``DEEPINFER_*`` environment variables.

Every package reads environment variables through this module, never through ``os.environ``
directly, so the full list is in one place and each value is parsed and validated once. An
explicit argument (``LLM(accelerator=...)``) beats the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r}: {e}") from None


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _int(raw: str) -> int:
    return int(raw.strip())


def _float(raw: str) -> float:
    return float(raw.strip())


def _accelerator(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("nvidia", "ascend", "cpu"):
        raise ValueError("expected nvidia, ascend or cpu")
    return value


def _truncation_mode(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("off", "mask", "compact"):
        raise ValueError("expected off, mask or compact")
    return value


REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar(
            "DEEPINFER_ACCELERATOR",
            _accelerator,
            None,
            "nvidia | ascend | cpu; unset: CUDA present -> nvidia, torch_npu present -> ascend, "
            "else cpu",
        ),
        EnvVar("DEEPINFER_HF_MODEL_DIR", str, None, "local checkpoint directory used as model"),
        EnvVar(
            "DEEPINFER_BATCH_INVARIANT",
            _bool,
            False,
            "a row's results never depend on what else is in the batch",
        ),
        EnvVar("DEEPINFER_USE_NEXTN_DECODE", _int, 5, "draft tokens per decode step; 0 disables"),
        EnvVar(
            "DEEPINFER_ENABLE_MTP_VARLEN",
            _bool,
            False,
            "confidence-scheduled variable-length verification",
        ),
        EnvVar(
            "DEEPINFER_MAX_BACKTRACKING_TOKENS",
            _int,
            16,
            "most tokens a grammar matcher or state ring can roll back",
        ),
        EnvVar(
            "DEEPINFER_XGRAMMAR_TIMEOUT",
            _float,
            20.0,
            "seconds a structured-output grammar may take to compile",
        ),
        EnvVar("DEEPINFER_ENFORCE_EAGER", _bool, False, "never capture CUDA graphs"),
        EnvVar(
            "DEEPINFER_SPEC_GRAPHS",
            _bool,
            True,
            "CUDA graphs for speculative steps (verification and the DSpark drafter); 0 runs "
            "them eagerly",
        ),
        EnvVar(
            "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE",
            _bool,
            False,
            "keep V4.1 Engram tables on the device even when they are large (default: host)",
        ),
        EnvVar(
            "DEEPINFER_ZERO_OVERHEAD_SCHEDULING",
            _bool,
            True,
            "asynchronous scheduling: prepare step N+1 while the device runs step N",
        ),
        EnvVar(
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
            _truncation_mode,
            "off",
            "SWA bounded replay (YoCo prefill truncation, V4.1): off | mask | compact",
        ),
        EnvVar(
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
            _int,
            0,
            "prompt rows the YoCo consumer layers keep; 0: sliding window + speculative tokens",
        ),
        EnvVar(
            "DEEPINFER_CACHE_DIR",
            str,
            None,
            "where measured facts are kept (step-cost curves in cost_curves/); unset: "
            "$XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer",
        ),
        EnvVar(
            "DEEPINFER_REMEASURE_STEP_COST",
            _bool,
            False,
            "measure the speculation planner's step-cost curve again instead of reusing the "
            "stored one (as LLM(spec_cost_curve='remeasure'))",
        ),
        EnvVar(
            "DEEPINFER_SYNC_GUARD",
            _bool,
            False,
            "debug: a decode step replaying a CUDA graph that synchronises with the host raises",
        ),
        EnvVar(
            "DEEPINFER_REFERENCE_OPS",
            _bool,
            False,
            "run every op's plain-PyTorch reference on the selected device (debugging, baselines)",
        ),
        EnvVar(
            "DEEPINFER_LOG_LEVEL",
            str,
            "INFO",
            "level of the deepinfer loggers: DEBUG, INFO, WARNING, ERROR or CRITICAL",
        ),
    ]
}


def get(name: str) -> Any:
    """Value of the registered environment variable ``name`` (parsed, or its default)."""
    try:
        var = REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered DEEPINFER_ environment variable") from None
    return var.get()


def batch_invariant() -> bool:
    return bool(get("DEEPINFER_BATCH_INVARIANT"))
