"""Cache rows in the model's own formats (:mod:`deepinfer.kernels.formats`)."""

from __future__ import annotations

import torch

from deepinfer.kernels.formats import RowFormat
from deepinfer.kernels.reference import cache_rows as ref
from deepinfer.kernels.registry import op

__all__ = ["pack_rows", "unpack_rows"]


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
