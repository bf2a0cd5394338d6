"""Reference packing of cache rows into their :class:`~deepinfer.kernels.formats.RowFormat`.

Quantisation follows :mod:`.quant` step for step (the same scale rule, the same rounding, the
same fp32 products), so ``unpack_rows(pack_rows(x))`` equals ``fp8_sim`` / ``fp4_sim`` of the
quantised columns bit for bit, the tail cast to ``tail_dtype``.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.formats import PackedRows, RowFormat
from deepinfer.kernels.reference import quant as Q


def _scales(groups: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scales ``[..., n]``, their bytes) of ``groups`` ``[..., n, block]``."""
    amax = groups.abs().amax(dim=-1)
    if fmt.code == "e4m3":
        value = Q._pow2_scale(amax, Q.FP8_AMAX_FLOOR, Q.E4M3_MAX)
    elif fmt.scale == "ue8m0":
        value = Q._pow2_scale(amax, Q.FP4_UE8M0_AMAX_FLOOR, Q.E2M1_MAX)
    else:
        e4m3 = Q.round_to_e4m3(amax.clamp_min(Q.FP4_E4M3_AMAX_FLOOR) / Q.E2M1_MAX)
        return e4m3.float(), e4m3.view(torch.uint8)
    if fmt.scale == "e4m3":
        return value, value.to(torch.float8_e4m3fn).view(torch.uint8)
    return value, (Q.pow2_ceil_exponent(value) + Q.E8M0_BIAS).to(torch.uint8)


def pack_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    if x.shape[-1] != fmt.dim:
        raise ValueError(f"x: expected [..., {fmt.dim}] rows for {fmt}, got {tuple(x.shape)}")
    lead = x.shape[:-1]
    groups = Q._grouped(x[..., : fmt.quantised], fmt.block)
    scale, scale_bytes = _scales(groups, fmt)
    if fmt.code == "e4m3":
        codes = Q.round_to_e4m3(groups / scale.unsqueeze(-1)).view(torch.uint8).flatten(-2)
    else:
        nibbles = Q.round_to_e2m1_codes(groups / scale.unsqueeze(-1)).flatten(-2)
        codes = Q.pack_fp4(nibbles).view(torch.uint8)
    out = torch.zeros(*lead, fmt.row_bytes, dtype=torch.uint8, device=x.device)
    t, c = fmt.tail_bytes, fmt.code_bytes
    if t:
        tail = x[..., fmt.quantised :].to(fmt.tail_dtype).contiguous()
        out[..., :t] = tail.view(torch.uint8)
    out[..., t : t + c] = codes
    out[..., t + c : t + c + fmt.num_scales] = scale_bytes
    return out


def check_write_args(
    cache: torch.Tensor,
    dst: torch.Tensor,
    values: torch.Tensor,
    fmt: RowFormat,
    src: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument of :func:`write_rows` that breaks its contract."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != fmt.row_bytes:
        raise ValueError(
            f"cache: expected uint8 [N, {fmt.row_bytes}] rows for {fmt}, got {cache.dtype} "
            f"{tuple(cache.shape)}"
        )
    if values.dim() != 2 or values.shape[1] != fmt.dim:
        raise ValueError(f"values: expected [n, {fmt.dim}] rows, got {tuple(values.shape)}")
    n = values.shape[0] if src is None else src.shape[0]
    if src is not None and (src.dim() != 1 or src.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"src: expected int32/int64 [n] rows of values, got {src.dtype} {tuple(src.shape)}"
        )
    if dst.shape != (n,) or dst.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"dst: expected int32/int64 [{n}] row numbers, got {dst.dtype} {tuple(dst.shape)}"
        )


def write_rows(
    cache: torch.Tensor,
    dst: torch.Tensor,
    values: torch.Tensor,
    fmt: RowFormat,
    src: torch.Tensor | None = None,
) -> torch.Tensor:
    check_write_args(cache, dst, values, fmt, src)
    rows = values if src is None else values[src.long()]
    return cache.index_copy_(0, dst.long(), pack_rows(rows, fmt))


def unpack_rows(
    rows: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.shape[-1] != fmt.row_bytes:
        raise ValueError(
            f"rows: expected uint8 [..., {fmt.row_bytes}] for {fmt}, got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    t, c = fmt.tail_bytes, fmt.code_bytes
    codes = rows[..., t : t + c]
    scale_bytes = rows[..., t + c : t + c + fmt.num_scales]
    if fmt.code == "e4m3":
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        values = Q.e2m1_codes_to_float(Q.unpack_fp4(codes))
    if fmt.scale == "ue8m0":
        scale = Q.e8m0_to_float(scale_bytes)
    else:
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    quantised = (Q._grouped(values, fmt.block) * scale.unsqueeze(-1)).flatten(-2).to(out_dtype)
    if not t:
        return quantised
    tail = rows[..., :t].contiguous().view(fmt.tail_dtype).to(out_dtype)
    return torch.cat([quantised, tail], dim=-1)


def rows_of(source, indices: torch.Tensor, out_dtype: torch.dtype = torch.float32):
    """Rows ``indices`` (clamped at 0) of a float tensor or of :class:`PackedRows`, as
    ``out_dtype`` values ``[*indices.shape, dim]``: packed rows are gathered, then unpacked."""
    if isinstance(source, PackedRows):
        return unpack_rows(source.data[indices.clamp(min=0)], source.fmt, out_dtype)
    return source[indices.clamp(min=0)].to(out_dtype)
