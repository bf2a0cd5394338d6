"""Tensor specs and the dtype names safetensors headers use.

A :class:`TensorSpec` is what the loader expects of one stored tensor. Float tensors accept any
float storage dtype (the checkpoints store BF16 and F32; our tests write F32): the value is
cast on load. Quantised and integer tensors must match their dtype family exactly, since a
wrong one cannot be converted meaningfully (a BF16 tensor where FP8 codes are expected means
the checkpoint does not match the config's quantisation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

FLOAT_FAMILY = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})
# Each stored dtype and the dtypes accepted in its place.
_FAMILIES: dict[torch.dtype, frozenset[torch.dtype]] = {
    **{d: FLOAT_FAMILY for d in FLOAT_FAMILY},
    torch.float8_e4m3fn: frozenset({torch.float8_e4m3fn}),
    torch.float8_e8m0fnu: frozenset({torch.float8_e8m0fnu, torch.uint8}),
    torch.int8: frozenset({torch.int8, torch.uint8}),  # packed e2m1 bytes
    torch.int64: frozenset({torch.int64, torch.int32}),
    torch.int32: frozenset({torch.int64, torch.int32}),
}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors spelling of ``dtype`` (``BF16``, ``F8_E4M3`` ...)."""
    return DTYPE_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor: shape, stored dtype, and whether text-only inference skips it.

    ``optional`` tensors are not reported missing (names not pinned down by public sources).
    ``unused``, when set, says why a stored tensor is accepted but never loaded (the model has
    no use for it, as in the reference implementation).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    skip: bool = False
    optional: bool = False
    unused: str = ""

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype in _FAMILIES.get(self.dtype, frozenset({self.dtype}))

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_FAMILY

    def describe(self) -> str:
        return f"{list(self.shape)} {dtype_name(self.dtype)}"


def as_specs(
    inventory: Mapping[str, TensorSpec | tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, TensorSpec]:
    """Accept an inventory of :class:`TensorSpec` or of plain ``(shape, dtype)`` pairs (what
    ``deepinfer.engine.model.expected_tensors`` returns)."""
    return {
        name: spec if isinstance(spec, TensorSpec) else TensorSpec(tuple(spec[0]), spec[1])
        for name, spec in inventory.items()
    }
