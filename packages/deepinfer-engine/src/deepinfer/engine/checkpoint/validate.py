"""Compare what a checkpoint stores with what the config expects, before loading anything."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deepinfer.engine.checkpoint.formats import TensorSpec, as_specs, dtype_name
from deepinfer.engine.checkpoint.index import CheckpointError, StoredTensor

MAX_LISTED = 20


@dataclass(frozen=True)
class Mismatch:
    """Everything wrong between a checkpoint and its expected inventory."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    misshaped: tuple[str, ...]
    wrong_dtype: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.misshaped or self.wrong_dtype)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's names, shapes or dtypes do not match the config; nothing was loaded."""

    def __init__(self, message: str, mismatch: Mismatch) -> None:
        super().__init__(message)
        self.mismatch = mismatch


def find_mismatches(
    stored: Mapping[str, StoredTensor], expected: Mapping[str, TensorSpec]
) -> Mismatch:
    missing = sorted(n for n, s in expected.items() if n not in stored and not s.optional)
    unexpected = sorted(n for n in stored if n not in expected)
    common = [n for n in stored if n in expected]
    misshaped = sorted(n for n in common if stored[n].shape != expected[n].shape)
    wrong_dtype = sorted(n for n in common if not expected[n].accepts(stored[n].dtype))
    return Mismatch(tuple(missing), tuple(unexpected), tuple(misshaped), tuple(wrong_dtype))


def _section(title: str, lines: list[str]) -> list[str]:
    if not lines:
        return []
    shown = [f"    {line}" for line in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        shown.append(f"    ... and {len(lines) - MAX_LISTED} more")
    return [f"  {title} ({len(lines)}):", *shown]


def describe_mismatch(
    mismatch: Mismatch,
    stored: Mapping[str, StoredTensor],
    expected: Mapping[str, TensorSpec],
    where: str,
) -> str:
    def found(name: str) -> str:
        s = stored[name]
        return f"{list(s.shape)} {dtype_name(s.dtype)} in {s.file.name}"

    counts = (
        f"{len(mismatch.missing)} missing, {len(mismatch.unexpected)} unexpected, "
        f"{len(mismatch.misshaped)} mis-shaped, {len(mismatch.wrong_dtype)} with the wrong dtype"
    )
    lines = [f"checkpoint {where} does not match its config ({counts}); nothing was loaded"]
    lines += _section(
        "missing", [f"{n}: expected {expected[n].describe()}" for n in mismatch.missing]
    )
    lines += _section("unexpected", [f"{n}: {found(n)}" for n in mismatch.unexpected])
    lines += _section(
        "mis-shaped",
        [f"{n}: found {found(n)}, expected {list(expected[n].shape)}" for n in mismatch.misshaped],
    )
    lines += _section(
        "wrong dtype",
        [
            f"{n}: found {dtype_name(stored[n].dtype)}, expected {dtype_name(expected[n].dtype)}"
            for n in mismatch.wrong_dtype
        ],
    )
    return "\n".join(lines)


def validate_checkpoint(
    stored: Mapping[str, StoredTensor],
    expected: Mapping[str, TensorSpec | tuple[tuple[int, ...], torch.dtype]],
    where: str = "",
) -> None:
    """Raise :class:`CheckpointMismatchError` naming every missing, unexpected, mis-shaped and
    wrong-dtype tensor; return quietly when the checkpoint matches.

    ``expected`` maps names to :class:`TensorSpec` or to plain ``(shape, dtype)`` pairs.
    """
    expected = as_specs(expected)
    mismatch = find_mismatches(stored, expected)
    if mismatch:
        message = describe_mismatch(mismatch, stored, expected, where or "(in memory)")
        raise CheckpointMismatchError(message, mismatch)
