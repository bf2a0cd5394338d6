"""The model's KV and state cache: a paged arena and per-sequence state slots (DESIGN.md 6).

Paged arena (grows with the sequence): for every layer that *owns* a compressed cache (each
compressed layer in V4; only the kv-source layers in V4.1) ``block_size / ratio`` compressed
entries per block of ``block_size`` sequence tokens, plus the matching indexer keys where the
layer has them. Blocks are addressed through per-sequence block tables handed in from outside.

State slots (fixed per sequence): each attention layer's sliding-window ring of
``window + max_draft`` rows (row of position ``p`` = ``p % ring``), and each compressor's partial
windows (``2 * ratio`` rows for the overlapped ratio-4 compressor, ``ratio`` otherwise, plus
``max_draft``; row of position ``p`` = ``p % rows``; the score rows hold the gate logits with
the position bias added). Addressed by a state-slot id per sequence. The Engram n-gram
history has its own per-slot tensor in :attr:`ModelCache.extra`.

Every tensor is flat ``[rows, width]`` so kernels index rows directly. When the model rounds
its cache (its own numerics, not the pure-float debug path), the window KV, the compressed
entries and the indexer keys are stored in the formats it rounds to (:func:`storage_formats`:
``uint8 [rows, row_bytes]``, FP8 / FP4 codes with their scales): :meth:`ModelCache.write` packs,
:meth:`ModelCache.rows` hands readers :class:`~deepinfer.kernels.PackedRows`, which they
dequantise to exactly the values a float cache would hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import deepinfer.kernels as K
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.variant import NoRounding, variant_of
from deepinfer.kernels import PackedRows, RowFormat


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of the cache: how many arena blocks and state slots, and how they are shaped."""

    num_blocks: int
    num_slots: int
    block_size: int = 128
    max_draft: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_slots", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CacheLayout.{name} = {getattr(self, name)}: expected > 0")
        if self.max_draft < 0:
            raise ValueError(f"CacheLayout.max_draft = {self.max_draft}: expected >= 0")


def overlapped(config: ModelConfig, layer_id: int) -> bool:
    """Whether a layer's compressor uses overlapping windows (V4's ratio 4)."""
    return config.compress_ratios[layer_id] == variant_of(config).overlap_ratio


def compressor_state_rows(config: ModelConfig, layer_id: int, max_draft: int = 0) -> int:
    """Ring rows of a compressor's partial windows: the rows one entry reads (``2 ratio``
    overlapped, else ``ratio``) plus ``max_draft``, so rejected drafts never overwrite a row a
    later step still reads (the same rule as the window ring)."""
    ratio = config.compress_ratios[layer_id]
    return (2 * ratio if overlapped(config, layer_id) else ratio) + max_draft


def storage_formats(config: ModelConfig, dtype: torch.dtype) -> dict[str, RowFormat]:
    """The row format of each cache kind (``window``, ``kv``, ``index_keys``) the model rounds
    to (:mod:`.variant`; spec 2.3, 2.6, 7.1), tails in ``dtype``; none without rounding. A kind
    whose width does not split into whole blocks (tiny test shapes) is not rounded, nor packed."""
    if isinstance(variant_of(config).kv_rounding(config), NoRounding):
        return {}
    hd, nope, idx = config.head_dim, config.nope_head_dim, config.index_head_dim
    if config.is_v41:
        kinds = {
            "window": (hd, "e4m3", 32, "ue8m0"),
            "kv": (hd, "e2m1", 16, "e4m3"),
        }
    else:
        kinds = {"window": (nope, "e4m3", 64, "ue8m0"), "kv": (nope, "e4m3", 64, "ue8m0")}
    kinds["index_keys"] = (idx, "e2m1", 32, "ue8m0")
    dims = {"window": hd, "kv": hd, "index_keys": idx}
    return {
        kind: RowFormat(dims[kind], quantised, code, block, scale, dtype)
        for kind, (quantised, code, block, scale) in kinds.items()
        if quantised and quantised % block == 0
    }


class ModelCache:
    """All cache tensors of one model, keyed ``"{layer}.{what}"``.

    what: ``window`` ``[num_slots * ring, head_dim]``; ``kv`` ``[num_blocks * epb, head_dim]``
    (epb = block_size / ratio); ``index_keys`` ``[num_blocks * epb, index_head_dim]``;
    ``comp_kv`` / ``comp_score`` ``[num_slots * rows, coff * head_dim]`` fp32;
    ``index_comp_kv`` / ``index_comp_score`` likewise at the indexer width (V4 CSA).
    ``window``, ``kv`` and ``index_keys`` are ``uint8 [rows, row_bytes]`` where
    :attr:`formats` has a format for the key (``packed=False``: always ``dtype``).
    """

    def __init__(
        self,
        config: ModelConfig,
        layout: CacheLayout,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        packed: bool = True,
    ) -> None:
        self.config, self.layout, self.dtype = config, layout, dtype
        self.ring_size = config.sliding_window + layout.max_draft
        self.kind_formats = storage_formats(config, dtype) if packed else {}
        self.formats: dict[str, RowFormat] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.extra: dict[str, torch.Tensor] = {}
        for layer_id in range(config.num_layers):
            self._allocate_layer(layer_id, torch.device(device))
        if config.engram_layer_ids:
            from deepinfer.engine.model.engram_history import history_ring_size, new_history

            ring = history_ring_size(config.engram_max_ngram_size, layout.max_draft)
            self.extra["engram_history"] = new_history(layout.num_slots, ring, device)

    def _allocate_layer(self, i: int, device: torch.device) -> None:
        c, lay = self.config, self.layout
        hd, idx_d = c.head_dim, c.index_head_dim
        slots = lay.num_slots
        self._rows(f"{i}.window", slots * self.ring_size, hd, device)
        ratio = c.compress_ratios[i]
        if ratio == 0 or not c.owns_compressor(i):
            return
        if lay.block_size % ratio:
            raise ValueError(
                f"block_size {lay.block_size} is not a multiple of layer {i}'s compression ratio "
                f"{ratio}: a KV block must hold whole compressed entries (choose a block_size "
                f"that every ratio in {sorted(set(c.compress_ratios) - {0})} divides)"
            )
        entries = lay.num_blocks * (lay.block_size // ratio)
        self._rows(f"{i}.kv", entries, hd, device)
        rows = slots * compressor_state_rows(c, i, lay.max_draft)
        coff = 2 if overlapped(c, i) else 1
        self._state(f"{i}.comp", rows, coff * hd, device)
        # V4: a CSA layer's indexer keeps its keys and its own compressor's state; V4.1: each
        # kv source keeps the index keys its group shares (derived from its own latent)
        own_index_compressor = variant_of(c).own_index_compressor
        if c.owns_indexer(i) or not own_index_compressor:
            self._rows(f"{i}.index_keys", entries, idx_d, device)
            if own_index_compressor:
                self._state(f"{i}.index_comp", rows, coff * idx_d, device)

    def _rows(self, key: str, rows: int, width: int, device: torch.device) -> None:
        """A cache tensor of ``rows`` rows of ``width`` values, packed if its kind has a
        format."""
        fmt = self.kind_formats.get(key.rsplit(".", 1)[1])
        if fmt is None:
            self.tensors[key] = torch.zeros(rows, width, dtype=self.dtype, device=device)
            return
        self.formats[key] = fmt
        self.tensors[key] = torch.zeros(rows, fmt.row_bytes, dtype=torch.uint8, device=device)

    def rows(self, key: str) -> torch.Tensor | PackedRows:
        """Tensor ``key`` as its readers take it: float rows, or :class:`PackedRows`."""
        fmt = self.formats.get(key)
        return self.tensors[key] if fmt is None else PackedRows(self.tensors[key], fmt)

    def gather(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` ``[n]`` of tensor ``key`` as float rows of :attr:`dtype` (packed rows
        dequantised: exact, every packed value is a float of the cache dtype)."""
        fmt, picked = self.formats.get(key), self.tensors[key].index_select(0, rows)
        return picked if fmt is None else K.unpack_rows(picked, fmt, self.dtype)

    def write(self, key: str, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Store float rows ``values`` ``[n, width]`` at rows ``dst`` of tensor ``key`` (packed
        in its format by one ``write_rows``, else cast to its dtype). Rows ``dst`` are distinct
        but for the scratch rows padding writes to, which nothing reads."""
        t, fmt = self.tensors[key], self.formats.get(key)
        if fmt is None:
            t.index_copy_(0, dst, values.to(t.dtype))
        else:
            K.write_rows(t, dst, values, fmt)

    def _state(self, name: str, rows: int, width: int, device: torch.device) -> None:
        self.tensors[f"{name}_kv"] = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.tensors[f"{name}_score"] = torch.full(
            (rows, width), float("-inf"), dtype=torch.float32, device=device
        )

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def is_arena(self, key: str) -> bool:
        """Whether tensor ``key`` lives in the paged arena (else in the state slots)."""
        return key.rsplit(".", 1)[1] in ARENA_KINDS


ARENA_KINDS = ("kv", "index_keys")


@dataclass(frozen=True)
class CacheFootprint:
    """Bytes one arena block and one state slot take (for sizing from free device memory)."""

    bytes_per_block: int
    bytes_per_slot: int

    def num_blocks(self, budget_bytes: int, num_slots: int) -> int:
        """Blocks that fit in ``budget_bytes`` after ``num_slots`` state slots."""
        left = budget_bytes - num_slots * self.bytes_per_slot
        return max(0, left // max(1, self.bytes_per_block))


def cache_footprint(
    config: ModelConfig,
    *,
    block_size: int = 128,
    max_draft: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    packed: bool = True,
) -> CacheFootprint:
    """Measured on a one-block, one-slot cache built on the meta device (no memory)."""
    layout = CacheLayout(num_blocks=1, num_slots=1, block_size=block_size, max_draft=max_draft)
    cache = ModelCache(config, layout, dtype=dtype, device="meta", packed=packed)
    per_block = per_slot = 0
    for key, t in cache.tensors.items():
        size = t.numel() * t.element_size()
        if cache.is_arena(key):
            per_block += size
        else:
            per_slot += size
    per_slot += sum(t.numel() * t.element_size() for t in cache.extra.values())
    return CacheFootprint(per_block, per_slot)
