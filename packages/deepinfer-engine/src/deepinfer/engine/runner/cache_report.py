"""What the KV cache of a model costs and holds, in words: each cache kind's storage format,
the bytes per token (the paged arena) and per sequence (the state slots), against a bf16
cache; logged at start-up next to the capacity and shown by ``deepinfer info --model DIR``."""

from __future__ import annotations

import torch

from deepinfer.engine.model.cache import cache_footprint, storage_formats
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.runner.capacity import CacheCapacity, plan_cache_capacity
from deepinfer.kernels import RowFormat

KINDS = {"window": "window KV", "kv": "compressed entries", "index_keys": "indexer keys"}


def _format(fmt: RowFormat | None, dtype: torch.dtype) -> str:
    plain = str(dtype).removeprefix("torch.")
    if fmt is None:
        return plain
    codes = "FP8 e4m3" if fmt.code == "e4m3" else "FP4 e2m1"
    text = f"{codes} x{fmt.quantised} ({fmt.scale} scale / {fmt.block})"
    if fmt.quantised < fmt.dim:
        text += f" + {plain} x{fmt.dim - fmt.quantised}"
    return f"{text}: {fmt.row_bytes} B/row"


def cache_lines(
    config: ModelConfig, *, block_size: int = 128, max_draft: int = 0, dtype=torch.bfloat16
) -> list[str]:
    """The cache's formats and bytes, one fact a line."""
    formats = storage_formats(config, dtype)
    packed = cache_footprint(config, block_size=block_size, max_draft=max_draft, dtype=dtype)
    plain = cache_footprint(
        config, block_size=block_size, max_draft=max_draft, dtype=dtype, packed=False
    )
    lines = [f"{name}: {_format(formats.get(kind), dtype)}" for kind, name in KINDS.items()]
    per_token, plain_token = packed.bytes_per_block / block_size, plain.bytes_per_block / block_size
    lines.append(
        f"per token: {per_token:.1f} B ({per_token / plain_token:.2f}x of {plain_token:.0f} B "
        f"in {str(dtype).removeprefix('torch.')})"
    )
    lines.append(
        f"per sequence (window rings, compressor state): {packed.bytes_per_slot / 2**20:.2f} MiB "
        f"({packed.bytes_per_slot / plain.bytes_per_slot:.2f}x)"
    )
    return lines


def estimate_capacity(
    config: ModelConfig,
    *,
    memory_bytes: int,
    used_bytes: int,
    utilization: float,
    max_num_seqs: int,
    block_size: int = 128,
    dtype=torch.bfloat16,
) -> CacheCapacity:
    """The capacity the engine would size for ``memory_bytes`` of which ``used_bytes`` hold the
    weights and activations (the start-up sizing without its profile run)."""
    footprint = cache_footprint(config, block_size=block_size, dtype=dtype)
    return plan_cache_capacity(
        total_memory_bytes=memory_bytes,
        peak_memory_bytes=used_bytes,
        gpu_memory_utilization=utilization,
        bytes_per_block=footprint.bytes_per_block,
        bytes_per_state_slot=footprint.bytes_per_slot,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
    )
