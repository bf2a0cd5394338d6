"""Reference FP8 / FP4 formats of the DeepSeek-V4 checkpoints and the reference numerics.

Formats (all scales are powers of two stored as ue8m0 bytes, bias 127, unless noted):

- FP8 block weights: ``float8_e4m3fn [out, in]`` with one scale per ``bm x bn`` block.
- FP4 (e2m1) values packed two per byte along the last dim: byte ``k`` holds logical column
  ``2k`` in its low nibble and ``2k + 1`` in its high nibble; bit 3 of a nibble is the sign.
  One scale per ``block`` consecutive logical columns.
- Activations: FP8 e4m3 per group of contiguous elements of the last dim, scale
  ``2^ceil(log2(max(amax, 1e-4) / 448))``.

Every computation happens in fp32; results are exact where the format allows it (a dequantised
value ``q * 2^e`` is exact in fp32 and in bf16).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
FP8_AMAX_FLOOR = 1e-4
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9

# Nibble code -> e2m1 value (codes 8..15 are the negatives, 8 is -0.0).
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# Midpoints between neighbouring magnitudes and whether a tie rounds up (to the even code).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


# ---------------------------------------------------------------------------------------------
# scale helpers


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes (``float8_e8m0fnu`` or ``uint8``) -> fp32 ``2^(byte - 127)``; 255 -> NaN."""
    exponent = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    value = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(scale.view(torch.uint8) == 255, float("nan"), value)


def pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` for positive fp32 ``x``, exactly (int32)."""
    mantissa, exponent = torch.frexp(x.float())
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """int exponents in [-127, 127] -> ``float8_e8m0fnu`` bytes."""
    if exponent.numel() and (exponent.min() < -E8M0_BIAS or exponent.max() > E8M0_BIAS):
        raise ValueError(
            f"scale exponent range [{int(exponent.min())}, {int(exponent.max())}] does not fit "
            f"ue8m0 (expected within [-127, 127])"
        )
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_scale(amax: torch.Tensor, floor: float, qmax: float) -> torch.Tensor:
    """The power-of-two scale ``2^ceil(log2(max(amax, floor) / qmax))`` (fp32)."""
    exponent = pow2_ceil_exponent(amax.float().clamp_min(floor) / qmax)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), exponent)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> ``float8_e4m3fn``, saturating at +-448, round to nearest even."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 nibble codes (``uint8`` 0..15), saturating at +-6, ties to even code."""
    magnitude = x.float().abs().clamp_max(E2M1_MAX)
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        above = magnitude >= midpoint if tie_up else magnitude > midpoint
        code += above.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 nibble codes (``uint8`` 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K]`` codes -> ``int8 [..., K/2]``: even column low nibble, odd high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``int8/uint8 [..., K/2]`` -> ``uint8 [..., K]`` codes (inverse of :func:`pack_fp4`)."""
    raw = packed.view(torch.uint8)
    return torch.stack((raw & 0x0F, raw >> 4), dim=-1).flatten(-2)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., K]`` -> fp32 ``[..., K/group, group]`` (K must divide)."""
    if group <= 0 or x.shape[-1] % group:
        raise ValueError(
            f"block/group size {group} must be positive and divide the last dim of the input "
            f"(shape {tuple(x.shape)})"
        )
    return x.float().unflatten(-1, (x.shape[-1] // group, group))


def _finish(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


# ---------------------------------------------------------------------------------------------
# FP8 block weights


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block_size: tuple[int, int]):
    rows = scale.repeat_interleave(block_size[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block_size[1], dim=1)[:, : shape[1]]


def fp8_block_dequant(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    values = _expand_blocks(e8m0_to_float(scale), weight.shape, block_size)
    return (weight.float() * values).to(out_dtype)


def fp8_block_quant(
    weight: torch.Tensor, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    bm, bn = block_size
    grid_rows, grid_cols = -(-rows // bm), -(-cols // bn)
    padded = weight.new_zeros((grid_rows * bm, grid_cols * bn), dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid_rows, bm, grid_cols, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    exponent = pow2_ceil_exponent(amax.clamp_min(FP8_AMAX_FLOOR) / E4M3_MAX)
    values = _expand_blocks(torch.ldexp(torch.ones_like(amax), exponent), weight.shape, block_size)
    return round_to_e4m3(weight.float() / values), exponent_to_e8m0(exponent)


# ---------------------------------------------------------------------------------------------
# FP4 (e2m1) weights


def fp4_dequant(
    packed: torch.Tensor,
    scale: torch.Tensor,
    block_size: int = 32,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    values = e2m1_codes_to_float(unpack_fp4(packed))
    scales = e8m0_to_float(scale).repeat_interleave(block_size, dim=-1)
    return (values * scales).to(out_dtype)


def fp4_quant(weight: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _grouped(weight, block_size)
    amax = groups.abs().amax(dim=-1)
    exponent = pow2_ceil_exponent(amax.clamp_min(FP4_UE8M0_AMAX_FLOOR) / E2M1_MAX)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponent).unsqueeze(-1)
    codes = round_to_e2m1_codes(scaled).flatten(-2)
    return pack_fp4(codes), exponent_to_e8m0(exponent)


# ---------------------------------------------------------------------------------------------
# activations and in-place-style simulations


def fp8_act_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _grouped(x, group_size)
    scale = _pow2_scale(groups.abs().amax(dim=-1), FP8_AMAX_FLOOR, E4M3_MAX)
    quantised = round_to_e4m3(groups / scale.unsqueeze(-1)).flatten(-2)
    return quantised, scale


def fp8_sim(x: torch.Tensor, block_size: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    quantised, scale = fp8_act_quant(x, block_size)
    result = _grouped(quantised, block_size) * scale.unsqueeze(-1)
    return _finish(result.flatten(-2).to(x.dtype), out)


def _fp4_scale(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "ue8m0":
        return _pow2_scale(amax, FP4_UE8M0_AMAX_FLOOR, E2M1_MAX)
    if scale_fmt == "e4m3":
        return round_to_e4m3(amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).float()
    raise ValueError(f"scale_fmt={scale_fmt!r}: expected 'ue8m0' or 'e4m3'")


def fp4_sim(
    x: torch.Tensor,
    block_size: int,
    *,
    scale_fmt: str = "ue8m0",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    groups = _grouped(x, block_size)
    scale = _fp4_scale(groups.abs().amax(dim=-1), scale_fmt).unsqueeze(-1)
    values = e2m1_codes_to_float(round_to_e2m1_codes(groups / scale)) * scale
    return _finish(values.flatten(-2).to(x.dtype), out)
