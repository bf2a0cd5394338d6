"""Reference sparse multi-query attention with a per-head sink."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.kernels.formats import PackedRows
from deepinfer.kernels.reference.cache_rows import rows_of

MAX_SOURCES = 3  # window rings, this step's tokens, compressed entries


def kv_sources(kv) -> tuple[torch.Tensor | PackedRows, ...]:
    """``kv`` as a tuple of ``[M_i, D]`` sources (float tensors or :class:`PackedRows`),
    checked: one width, float dtypes."""
    sources = (kv,) if isinstance(kv, (torch.Tensor, PackedRows)) else tuple(kv)
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(
            f"kv: expected a tensor or 1..{MAX_SOURCES} [M_i, D] tensors, got {len(sources)}"
        )
    width = sources[0].shape[-1]
    for i, s in enumerate(sources):
        if isinstance(s, PackedRows):
            if s.fmt.dim != width:
                raise ValueError(f"kv[{i}]: expected [M, {width}] rows, got {s.fmt}")
            continue
        if not isinstance(s, torch.Tensor) or s.dim() != 2 or s.shape[1] != width:
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"kv[{i}]: expected a [M, {width}] tensor, got {shape}")
        if not s.dtype.is_floating_point:
            raise ValueError(f"kv[{i}]: expected a float dtype, got {s.dtype}")
    return sources


def gather_rows(kv, indices: torch.Tensor) -> torch.Tensor:
    """``[*indices.shape, D]`` fp32: row ``indices[...]`` of the sources' virtual concatenation
    (``-1``: a zero row), read from each source in place (packed rows dequantised)."""
    sources = kv_sources(kv)
    idx = indices.long()
    if len(sources) == 1:
        return rows_of(sources[0], idx)
    out = torch.zeros(*idx.shape, sources[0].shape[1], dtype=torch.float32, device=idx.device)
    start = 0
    for s in sources:
        inside = (idx >= start) & (idx < start + s.shape[0])
        out[inside] = rows_of(s, idx[inside] - start)
        start += s.shape[0]
    return out


def sparse_mqa_sink(
    q: torch.Tensor,
    kv: torch.Tensor | PackedRows | Sequence[torch.Tensor | PackedRows],
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    valid = indices >= 0  # [T, K]
    gathered = gather_rows(kv, indices)  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), gathered) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    peak = torch.maximum(logits.amax(-1, keepdim=True), sink_logit)
    probs = torch.exp(logits - peak)
    denom = probs.sum(-1, keepdim=True) + torch.exp(sink_logit - peak)
    out = torch.einsum("thk,tkd->thd", probs / denom, gathered)
    return out.to(q.dtype)


def join_index_lists(first: torch.Tensor, second: torch.Tensor, offset: int) -> torch.Tensor:
    check_index_lists(first, second)
    moved = torch.where(second >= 0, second + offset, second).to(first.dtype)
    return torch.cat([first, moved], dim=1)


def check_index_lists(first: torch.Tensor, second: torch.Tensor) -> None:
    """ValueError naming the argument of :func:`join_index_lists` that breaks its contract."""
    for name, t in (("first", first), ("second", second)):
        if t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected int32/int64 [T, n], got {t.dtype} {tuple(t.shape)}")
    if second.shape[0] != first.shape[0]:
        raise ValueError(f"second: expected {first.shape[0]} rows, got {second.shape[0]}")
