"""Cache rows in the model's own formats (:mod:`deepinfer.kernels.formats`)."""

from __future__ import annotations

import torch

from deepinfer.kernels.formats import RowFormat
from deepinfer.kernels.reference import cache_rows as ref
from deepinfer.kernels.registry import op

__all__ = ["pack_rows", "unpack_rows", "write_rows"]


@op(reference=ref.pack_rows)
def pack_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Float rows ``[..., fmt.dim]`` -> ``uint8 [..., fmt.row_bytes]`` in ``fmt``.

    The first ``fmt.quantised`` columns, per block of ``fmt.block``: e4m3 codes with the
    activation rule of :func:`fp8_act_quant` (``s = 2^ceil(log2(max(amax, 1e-4) / 448))``),
    or e2m1 codes with the scale rule of :func:`fp4_sim` for ``fmt.scale``; the tail cast to
    ``fmt.tail_dtype``. ``unpack_rows(pack_rows(x))`` is ``fp8_sim`` / ``fp4_sim`` of those
    columns bit for bit.
    """


@op(reference=ref.unpack_rows)
def unpack_rows(
    rows: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``uint8 [..., fmt.row_bytes]`` rows in ``fmt`` -> ``[..., fmt.dim]`` of ``out_dtype``:
    ``code * scale`` in fp32 (exact), then cast; the tail cast from ``fmt.tail_dtype``."""


@op(reference=ref.write_rows)
def write_rows(
    cache: torch.Tensor,
    dst: torch.Tensor,
    values: torch.Tensor,
    fmt: RowFormat,
    src: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store float rows ``values`` ``[n, fmt.dim]`` packed in ``fmt`` at rows ``dst``
    (``int32``/``int64 [n]``, distinct, in ``[0, N)``) of ``cache`` ``uint8 [N, fmt.row_bytes]``,
    in place; returns ``cache``. The bytes are :func:`pack_rows`'s; the other rows are
    untouched. A backend may pack and scatter in one pass (the cache write of every step).
    ``src``: ``int32``/``int64 [n]`` rows of ``values`` ``[m, fmt.dim]`` to store instead
    (``values[src[i]]`` at ``dst[i]``: a gather in the same pass)."""
