"""What sets V4 and V4.1 apart, gathered in one record each family's modules read once, when
they are built: the shared modules hold the pieces picked here, never a family test in a
forward.

Numerics follow the official references (spec 2.3, 4.3, 7.1): V4 rounds the window KV and the
compressed entries to FP8 on the nope dims (block 64) and its reference activations in groups
of 128; V4.1 rounds the window KV to FP8 over the whole row (block 32), the compressed entries
to FP4 with e4m3 scales (block 16), and its activations in groups of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.hc import DeferredMix, ImmediateMix


class NoRounding:
    """Plain floating point (quantisation simulation off)."""

    def kv(self, kv: torch.Tensor) -> torch.Tensor:
        return kv

    def entries(self, entries: torch.Tensor) -> torch.Tensor:
        return entries


class V4Rounding:
    """FP8 (block 64) on the nope dims of window KV and compressed entries alike."""

    def __init__(self, config: ModelConfig) -> None:
        self.nope_dim = config.nope_head_dim

    def kv(self, kv: torch.Tensor) -> torch.Tensor:
        nope = self.nope_dim
        return torch.cat([K.fp8_sim(kv[..., :nope], 64), kv[..., nope:]], dim=-1)

    def entries(self, entries: torch.Tensor) -> torch.Tensor:
        return self.kv(entries)


class V41Rounding:
    """FP8 (block 32) on the whole window-KV row; FP4 (e4m3 scales, block 16) on entries."""

    def __init__(self, config: ModelConfig) -> None:
        pass

    def kv(self, kv: torch.Tensor) -> torch.Tensor:
        return K.fp8_sim(kv, 32)

    def entries(self, entries: torch.Tensor) -> torch.Tensor:
        return K.fp4_sim(entries, 16, scale_fmt="e4m3")


@dataclass(frozen=True)
class Variant:
    """One family's construction-time choices.

    name: the checkpoint family (draft-head tensor names); overlap_ratio: compressors of this
    ratio pool overlapping windows (None: none do); compressor_ape: compressors add a learned
    position bias; query_head_norm: each query head is RMS-normalised (no weight);
    own_index_compressor: CSA indexers compress their own keys (else they derive them from the
    kv source's latent and share them); activation_group: the reference's FP8 activation group
    when the checkpoint names no block size; router_norm_eps / router_temperature /
    router_image_bias: the gate's normalisation epsilon, whether it divides by ``gate_temp``,
    and whether it stores ``bias_vl``; mix: how the mHC streams thread through the blocks;
    rounding: the reference KV rounding, used when simulating quantisation.
    """

    name: str
    overlap_ratio: int | None
    compressor_ape: bool
    query_head_norm: bool
    own_index_compressor: bool
    activation_group: int
    router_norm_eps: float
    router_temperature: bool
    router_image_bias: bool
    mix: ImmediateMix | DeferredMix
    rounding: type[V4Rounding] | type[V41Rounding]

    def kv_rounding(self, config: ModelConfig) -> NoRounding | V4Rounding | V41Rounding:
        """The KV and compressed-entry rounding of ``config`` (identity without simulation)."""
        return self.rounding(config) if config.quant_simulation else NoRounding()


V4 = Variant(
    name="v4",
    overlap_ratio=4,
    compressor_ape=True,
    query_head_norm=True,
    own_index_compressor=True,
    activation_group=128,
    router_norm_eps=0.0,
    router_temperature=False,
    router_image_bias=False,
    mix=ImmediateMix(),
    rounding=V4Rounding,
)
V41 = Variant(
    name="v41",
    overlap_ratio=None,
    compressor_ape=False,
    query_head_norm=False,
    own_index_compressor=False,
    activation_group=32,
    router_norm_eps=1e-20,
    router_temperature=True,
    router_image_bias=True,
    mix=DeferredMix(),
    rounding=V41Rounding,
)


def variant_of(config: ModelConfig) -> Variant:
    return V41 if config.is_v41 else V4
