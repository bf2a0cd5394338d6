"""``load_format="dummy"``: random weights of the real shapes and dtypes, no file read.

Tensors are filled in place on their own device. Magnitudes keep a forward finite: linear
weights dequantise to about ``1 / sqrt(fan_in)``, norms are ones, mHC parameters small, router
biases zero; FP8 codes stay away from NaN, ue8m0 scales are valid powers of two, and
``tid2eid`` rows hold distinct valid expert ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from deepinfer.kernels.reference.quant import E8M0_BIAS

FP8_CODE_STD = 2.0  # std of the random e4m3 codes before scaling
FP4_CODE_STD = 3.0  # std of uniformly random e2m1 codes (magnitudes 0..6)


class _Generators:
    """One seeded generator per device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.by_device: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device) -> torch.Generator:
        if device not in self.by_device:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self.by_device[device] = gen
        return self.by_device[device]


def _fan_in(name: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """Input width of the linear a weight or scale belongs to (packed FP4 counts two)."""
    weight = tensors.get(name.removesuffix(".scale") + ".weight", tensors[name])
    width = weight.shape[-1] if weight.dim() > 1 else weight.shape[0]
    return int(width) * (2 if weight.dtype in (torch.int8, torch.uint8) else 1)


def _scale_byte(name: str, tensors: Mapping[str, torch.Tensor]) -> int:
    weight = tensors.get(name.removesuffix(".scale") + ".weight")
    code_std = FP4_CODE_STD if weight is not None and weight.dtype == torch.int8 else FP8_CODE_STD
    exponent = round(math.log2(code_std * math.sqrt(_fan_in(name, tensors))))
    return E8M0_BIAS - exponent


def _float_std(name: str, t: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> float | None:
    """Std of a float tensor's fill; None means fill with the constant 1 (norm weights)."""
    leaf = name.rsplit(".", 1)[-1]
    if (
        name.endswith("norm.weight")
        or name.endswith("norm1.weight")
        or name.endswith("norm2.weight")
    ):
        return None
    if leaf in ("bias", "bias_vl") or name.endswith("attn_sink"):
        return 0.0
    if "hc_" in name or name.endswith(".ape"):
        return 0.1 / math.sqrt(t.shape[-1]) if t.dim() > 1 else 0.1
    if name.endswith("embed.weight") and t.dim() == 2:
        return 1.0
    if t.dim() >= 2:
        return 1.0 / math.sqrt(t.shape[-1])
    return 0.02


def _fill_tid2eid(name: str, t: torch.Tensor, tensors, gen) -> None:
    gate = tensors.get(name.removesuffix("tid2eid") + "weight")
    n_experts = gate.shape[0] if gate is not None else max(t.shape[1], 1)
    scores = torch.rand(t.shape[0], n_experts, device=t.device, generator=gen)
    t.copy_(scores.topk(t.shape[1], dim=-1).indices)


@torch.no_grad()
def fill_dummy(target: nn.Module | Mapping[str, torch.Tensor], *, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer of ``target`` in place with random values."""
    tensors = dict(target.state_dict()) if isinstance(target, nn.Module) else dict(target)
    generators = _Generators(seed)
    for name, t in tensors.items():
        if t.is_meta or t.numel() == 0:
            continue
        gen = generators(t.device)
        if t.dtype == torch.float8_e8m0fnu:
            t.view(torch.uint8).fill_(_scale_byte(name, tensors))
        elif t.dtype == torch.float8_e4m3fn:
            codes = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device)
            t.copy_(codes.normal_(0.0, FP8_CODE_STD, generator=gen).clamp_(-448, 448))
        elif t.dtype in (torch.int8, torch.uint8):
            t.random_(
                -128 if t.dtype == torch.int8 else 0,
                128 if t.dtype == torch.int8 else 256,
                generator=gen,
            )
        elif name.endswith("tid2eid"):
            _fill_tid2eid(name, t, tensors, gen)
        elif t.is_floating_point():
            std = _float_std(name, t, tensors)
            if std is None:
                t.fill_(1.0)
            elif std == 0.0:
                t.zero_()
            else:
                t.normal_(0.0, std, generator=gen)
        else:
            t.zero_()
