"""Row formats of the KV cache: how one cache row of ``dim`` values is stored as bytes.

The DeepSeek-V4 family defines its cache in narrow formats (window KV in FP8 with the RoPE tail
kept wider, V4.1's compressed latents and the indexer keys in FP4). A :class:`RowFormat` names
one of them; :func:`deepinfer.kernels.pack_rows` writes rows in it and the readers (attention's
KV sources, the indexer's keys) take the bytes as :class:`PackedRows` and dequantise on read.

Byte layout of a row (``row_bytes``, a multiple of 16 so every row and its tail are aligned):
``[tail | codes | scales | padding]``: the last ``dim - quantised`` columns in ``tail_dtype``,
then the first ``quantised`` columns as e4m3 bytes or e2m1 nibbles (two per byte, the even
column in the low nibble), then one scale byte per ``block`` codes (``ue8m0``: ``2^(b - 127)``;
``e4m3``: an e4m3 value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODES = ("e4m3", "e2m1")
SCALES = ("ue8m0", "e4m3")
ROW_ALIGN = 16


@dataclass(frozen=True)
class RowFormat:
    """dim: values per row; quantised: the leading columns stored as ``code`` in blocks of
    ``block`` with one ``scale`` byte each; the rest (the tail) kept in ``tail_dtype``."""

    dim: int
    quantised: int
    code: str
    block: int
    scale: str
    tail_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"RowFormat.code = {self.code!r}: expected one of {CODES}")
        if self.scale not in SCALES:
            raise ValueError(f"RowFormat.scale = {self.scale!r}: expected one of {SCALES}")
        if not 0 < self.quantised <= self.dim:
            raise ValueError(
                f"RowFormat.quantised = {self.quantised}: expected 1..dim ({self.dim})"
            )
        if (
            self.block <= 0
            or self.quantised % self.block
            or (self.code == "e2m1" and self.block % 2)
        ):
            raise ValueError(
                f"RowFormat.block = {self.block}: expected a positive (for e2m1 even) divisor "
                f"of quantised ({self.quantised})"
            )
        if not self.tail_dtype.is_floating_point:
            raise ValueError(f"RowFormat.tail_dtype = {self.tail_dtype}: expected a float dtype")

    @property
    def tail_bytes(self) -> int:
        return (self.dim - self.quantised) * self.tail_dtype.itemsize

    @property
    def code_bytes(self) -> int:
        return self.quantised if self.code == "e4m3" else self.quantised // 2

    @property
    def num_scales(self) -> int:
        return self.quantised // self.block

    @property
    def row_bytes(self) -> int:
        used = self.tail_bytes + self.code_bytes + self.num_scales
        return -(-used // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class PackedRows:
    """Cache rows stored in ``fmt``: ``data`` ``uint8 [M, fmt.row_bytes]`` (row-major rows of a
    cache tensor, or a row range of one). Reads as ``[M, fmt.dim]`` values."""

    data: torch.Tensor
    fmt: RowFormat

    def __post_init__(self) -> None:
        d = self.data
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != self.fmt.row_bytes:
            raise ValueError(
                f"PackedRows.data: expected uint8 [M, {self.fmt.row_bytes}], got {d.dtype} "
                f"{tuple(d.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.fmt.dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> PackedRows:
        """A row range (``rows`` a slice), still packed."""
        return PackedRows(self.data[rows], self.fmt)
