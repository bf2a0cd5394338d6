"""What sets V4 and V4.1 apart, gathered in one record each family's modules read once, when
they are built: the shared modules hold the pieces picked here, never a family test in a
forward.

Numerics (``ModelConfig.numerics == "model"``, spec 2.3, 2.6, 4.3, 7.1) round what the model
stores and scores: V4 the window KV and the compressed entries to FP8 on the nope dims (block
64) and its indexer queries and keys to FP4 after a Hadamard rotation (block 32); V4.1 the window
KV to FP8 over the whole row (block 32), the compressed entries to FP4 with e4m3 scales (block
16) and its indexer queries and keys to FP4 (block 32). A row that does not split into whole
blocks stays unrounded, as in the public transformers port (only tiny test shapes do that).
``numerics == "float"`` rounds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.hc import DeferredMix, ImmediateMix

INDEX_BLOCK = 32  # FP4 block of the indexer queries and keys, both families


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class NoRounding:
    """Plain floating point (``numerics="float"``)."""

    kv = entries = index = staticmethod(_identity)


class V4Rounding:
    """FP8 (block 64) on the nope dims of window KV and compressed entries alike; indexer
    queries and keys Hadamard-rotated then FP4 (ue8m0 scales, block 32)."""

    def __init__(self, config: ModelConfig) -> None:
        self.nope_dim = config.nope_head_dim
        self.rounds_kv = self.nope_dim % 64 == 0
        self.rounds_index = config.index_head_dim % INDEX_BLOCK == 0

    def kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Rounds ``kv`` in place (callers pass a fresh tensor): one launch, no concatenation."""
        if not self.rounds_kv:
            return kv
        nope = kv[..., : self.nope_dim]
        K.fp8_sim(nope, 64, out=nope)
        return kv

    def entries(self, entries: torch.Tensor) -> torch.Tensor:
        return self.kv(entries)

    def index(self, x: torch.Tensor) -> torch.Tensor:
        """The rotation cancels in the q . k product, so it only matters before rounding."""
        if not self.rounds_index:
            return x
        return K.fp4_sim(K.hadamard_rotate(x), INDEX_BLOCK)


class V41Rounding:
    """FP8 (block 32) on the whole window-KV row; FP4 (e4m3 scales, block 16) on entries;
    indexer queries and keys FP4 (ue8m0 scales, block 32), unrotated."""

    def __init__(self, config: ModelConfig) -> None:
        self.rounds_kv = config.head_dim % 32 == 0
        self.rounds_entries = config.head_dim % 16 == 0
        self.rounds_index = config.index_head_dim % INDEX_BLOCK == 0

    def kv(self, kv: torch.Tensor) -> torch.Tensor:
        return K.fp8_sim(kv, 32) if self.rounds_kv else kv

    def entries(self, entries: torch.Tensor) -> torch.Tensor:
        return K.fp4_sim(entries, 16, scale_fmt="e4m3") if self.rounds_entries else entries

    def index(self, x: torch.Tensor) -> torch.Tensor:
        return K.fp4_sim(x, INDEX_BLOCK) if self.rounds_index else x


@dataclass(frozen=True)
class Variant:
    """One family's construction-time choices.

    name: the checkpoint family (draft-head tensor names); overlap_ratio: compressors of this
    ratio pool overlapping windows (None: none do); compressor_ape: compressors add a learned
    position bias; query_head_norm: each query head is RMS-normalised (no weight);
    own_index_compressor: CSA indexers compress their own keys (else they derive them from the
    kv source's latent and share them); router_norm_eps / router_temperature /
    router_image_bias: the gate's normalisation epsilon, whether it divides by ``gate_temp``,
    and whether it stores ``bias_vl``; mix: how the mHC streams thread through the blocks;
    rounding: the cache and indexer rounding of ``numerics="model"``.
    """

    name: str
    overlap_ratio: int | None
    compressor_ape: bool
    query_head_norm: bool
    own_index_compressor: bool
    router_norm_eps: float
    router_temperature: bool
    router_image_bias: bool
    mix: ImmediateMix | DeferredMix
    rounding: type[V4Rounding] | type[V41Rounding]

    def kv_rounding(self, config: ModelConfig) -> NoRounding | V4Rounding | V41Rounding:
        """The cache and indexer rounding of ``config`` (the identity for ``"float"``)."""
        return self.rounding(config) if config.numerics == "model" else NoRounding()


V4 = Variant(
    name="v4",
    overlap_ratio=4,
    compressor_ape=True,
    query_head_norm=True,
    own_index_compressor=True,
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
    router_norm_eps=1e-20,
    router_temperature=True,
    router_image_bias=True,
    mix=DeferredMix(),
    rounding=V41Rounding,
)


def variant_of(config: ModelConfig) -> Variant:
    return V41 if config.is_v41 else V4
