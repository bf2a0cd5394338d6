"""Fake quantisation of the tiny model's weights, batched by shape, bit-identical to the export.

The exported checkpoint stores each weight in its official format (spec 4.2, 7.1): FP8 e4m3
with one power-of-two (ue8m0) scale per 32x32 block, routed experts as FP4 e2m1 with one
ue8m0 scale per 32 columns, the Engram table as FP8 rows with one scale per 32 columns, BF16
for the tensors the format keeps in BF16, F32 for the rest. :func:`fake_quantise` maps a
stack of same-shaped weights to exactly the values the engine dequantises (the same rounding
helpers as ``deepinfer.kernels`` ``fp8_block_quant`` / ``fp4_quant``), so

- ``fake_quantise_(model)`` makes a dense model compute with the shipped weights, and
- quantisation-aware training swaps the rounded weights in for forward + backward and the
  fp32 masters back before the optimiser step (a straight-through estimator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine.checkpoint.inventory import ENGRAM_SCALE_BLOCK, official_inventory
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.kernels.reference.quant import (
    E2M1_MAX,
    E4M3_MAX,
    FP4_UE8M0_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    e2m1_codes_to_float,
    pow2_ceil_exponent,
    round_to_e2m1_codes,
    round_to_e4m3,
)

FP4_BLOCK = 32


def _pow2(amax: torch.Tensor, floor: float, qmax: float) -> torch.Tensor:
    exponent = pow2_ceil_exponent(amax.clamp_min(floor) / qmax)
    return torch.ldexp(torch.ones_like(amax), exponent)


def fake_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[N, R, C]`` -> fp32 values after FP8 e4m3 with a ue8m0 scale per ``block`` (R, C
    multiples of the block)."""
    n, rows, cols = w.shape
    bm, bn = block
    blocks = w.float().view(n, rows // bm, bm, cols // bn, bn)
    scale = _pow2(blocks.abs().amax(dim=(2, 4), keepdim=True), FP8_AMAX_FLOOR, E4M3_MAX)
    return (round_to_e4m3(blocks / scale).float() * scale).view(n, rows, cols)


def fake_fp4(w: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` -> fp32 values after FP4 e2m1 with a ue8m0 scale per 32 columns."""
    groups = w.float().unflatten(-1, (w.shape[-1] // FP4_BLOCK, FP4_BLOCK))
    scale = _pow2(groups.abs().amax(-1, keepdim=True), FP4_UE8M0_AMAX_FLOOR, E2M1_MAX)
    return (e2m1_codes_to_float(round_to_e2m1_codes(groups / scale)) * scale).flatten(-2)


@dataclass
class QuantGroup:
    """Same-shaped parameters stored in one format: ``kind`` fp8 (``block``), fp4 or bf16."""

    kind: str
    block: tuple[int, int] | None
    names: list[str] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)

    def fake(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return fake_fp8_blocks(stacked, self.block)
        if self.kind == "fp4":
            return fake_fp4(stacked)
        return stacked.to(torch.bfloat16).float()


def quant_groups(model: torch.nn.Module, config: dict[str, Any]) -> list[QuantGroup]:
    """Group ``model``'s parameters (official names) by stored format and shape.

    ``config``: the quantised ``config.json`` dict the export writes. F32 tensors (mHC, sinks,
    router biases) are not grouped: the format stores them exactly."""
    parsed = parse_config(config)
    inventory = official_inventory(parsed, include_mtp=True, include_vision=False)
    groups: dict[tuple, QuantGroup] = {}
    for name, p in model.named_parameters():
        spec = inventory.get(name)
        if spec is None or not p.is_floating_point():
            continue
        if spec.dtype == torch.float8_e4m3fn:
            engram = name.endswith("engram.embed.weight")
            kind, block = "fp8", (1, ENGRAM_SCALE_BLOCK) if engram else parsed.weight_block
            if p.shape[0] % block[0] or p.shape[1] % block[1]:
                raise ValueError(f"{name} shape {list(p.shape)} is not a multiple of {block}")
        elif spec.dtype == torch.int8:
            kind, block = "fp4", None
        elif spec.dtype == torch.bfloat16:
            kind, block = "bf16", None
        else:
            continue
        group = groups.setdefault((kind, block, tuple(p.shape)), QuantGroup(kind, block))
        group.names.append(name)
        group.params.append(p)
    return list(groups.values())


@torch.no_grad()
def swap_in_quantised(groups: list[QuantGroup]) -> list[torch.Tensor]:
    """Overwrite every grouped parameter with its stored value; returns the originals (one
    stacked tensor per group) for :func:`restore`."""
    saved = []
    for g in groups:
        stacked = torch.stack([p.detach() for p in g.params])
        saved.append(stacked)
        rounded = g.fake(stacked).to(stacked.dtype)
        torch._foreach_copy_([p.data for p in g.params], list(rounded.unbind(0)))
    return saved


@torch.no_grad()
def restore(groups: list[QuantGroup], saved: list[torch.Tensor]) -> None:
    """Put back the values :func:`swap_in_quantised` returned."""
    for g, stacked in zip(groups, saved):
        torch._foreach_copy_([p.data for p in g.params], list(stacked.unbind(0)))
