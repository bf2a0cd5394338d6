"""The value checks of :class:`~deepinfer.engine.config.EngineConfig`'s parameters: each
``check(name, value)`` raises ValueError naming the parameter and what it expects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

YOCO_TRUNCATION_MODES = ("off", "mask", "compact")


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")

    return check


def positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")


def optional_positive_int(name: str, value: Any) -> None:
    if value is not None:
        positive_int(name, value)


def integer(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: expected an integer")


def fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r}: expected a number in (0, 1]")


def positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}: expected a number > 0")


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected a bool")


def optional_bool(name: str, value: Any) -> None:
    if value not in (None, True, False):
        raise ValueError(f"{name}={value!r}: expected None, True or False")


def optional_truncation_mode(name: str, value: Any) -> None:
    if value is not None:
        choice(YOCO_TRUNCATION_MODES)(name, value)


def optional_count(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}={value!r}: expected None or an integer >= 0")


def model_name(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={value!r}: expected a hub id or a directory")


def draft_count(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"{name}={value!r}: expected None (DEEPINFER_USE_NEXTN_DECODE) or an integer >= 0 "
            "(0 disables speculation)"
        )


def cost_curve(name: str, value: Any) -> None:
    if value is not None and value != "remeasure" and not callable(getattr(value, "costs", None)):
        raise ValueError(
            f"{name}={value!r}: expected a deepinfer.spec.StepCostCurve, 'remeasure' or None"
        )
