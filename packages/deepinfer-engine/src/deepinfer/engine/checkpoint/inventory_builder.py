"""How a checkpoint stores each kind of weight: the tensor formats of an inventory entry.

An FP8 linear ``x`` is stored as ``x.weight`` (``F8_E4M3``) plus ``x.scale`` (``F8_E8M0``, one
per weight block); routed experts as packed e2m1 ``x.weight`` (``I8 [out, in / 2]``) plus
``x.scale`` (``F8_E8M0 [out, in / 32]``). An unquantised checkpoint has plain float
``x.weight`` tensors and no scales.
"""

from __future__ import annotations

import torch

from deepinfer.engine.checkpoint.formats import TensorSpec
from deepinfer.engine.model.config import ModelConfig

BF16, F32 = torch.bfloat16, torch.float32
FP8, E8M0, PACKED_FP4 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8
FP4_SCALE_BLOCK = 32
ENGRAM_SCALE_BLOCK = 32


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class InventoryBuilder:
    """Collects ``{name: TensorSpec}``; knows how the config stores each kind of weight."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.quant = config.quantization
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = BF16, **kw) -> None:
        if name in self.specs:
            raise RuntimeError(f"inventory lists {name!r} twice")
        self.specs[name] = TensorSpec(tuple(int(s) for s in shape), dtype, **kw)

    def linear(self, prefix: str, out: int, inp: int, **kw) -> None:
        """An FP8 block-scaled linear when quantised, else a plain float weight."""
        if self.quant is None:
            self.add(f"{prefix}.weight", (out, inp), **kw)
            return
        bm, bn = self.quant.weight_block_size
        self.add(f"{prefix}.weight", (out, inp), FP8, **kw)
        self.add(f"{prefix}.scale", (_ceil_div(out, bm), _ceil_div(inp, bn)), E8M0, **kw)

    def expert_linear(self, prefix: str, out: int, inp: int) -> None:
        """A routed expert's weight: packed FP4 when ``expert_dtype`` is fp4."""
        if self.quant is None or self.quant.expert_dtype != "fp4":
            self.linear(prefix, out, inp)
            return
        self.add(f"{prefix}.weight", (out, inp // 2), PACKED_FP4)
        self.add(f"{prefix}.scale", (out, inp // FP4_SCALE_BLOCK), E8M0)
