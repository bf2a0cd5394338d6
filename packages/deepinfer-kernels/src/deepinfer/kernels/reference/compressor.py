"""Reference softmax pooling of compressor windows."""

from __future__ import annotations

import torch


def compress_pool(
    kv: torch.Tensor, score: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    weights = torch.softmax(score.float(), dim=1)
    return (weights * kv.float()).sum(dim=1).to(out_dtype)


def compress_gather_pool(
    first_kv: torch.Tensor,
    first_score: torch.Tensor,
    second_kv: torch.Tensor,
    second_score: torch.Tensor,
    rows: torch.Tensor,
    *,
    overlap: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    check_gather_pool(first_kv, first_score, second_kv, second_score, rows, overlap)
    src = rows.long().clamp(min=0)
    kv = torch.cat([first_kv, second_kv.to(first_kv.dtype)])[src]
    score = torch.cat([first_score, second_score]).float()[src]
    score.masked_fill_((rows < 0).unsqueeze(-1), float("-inf"))
    if overlap:
        r, d = rows.shape[1] // 2, kv.shape[2] // 2
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
    return compress_pool(kv, score, out_dtype=out_dtype)


def check_gather_pool(first_kv, first_score, second_kv, second_score, rows, overlap) -> None:
    """The shapes :func:`compress_gather_pool` takes (ValueError naming the argument)."""
    width = first_kv.shape[-1] if first_kv.dim() == 2 else None
    for name, t, n in (("first_kv", first_kv, None), ("first_score", first_score, first_kv),
                       ("second_kv", second_kv, None), ("second_score", second_score, second_kv)):  # fmt: skip
        if t.dim() != 2 or t.shape[1] != width or (n is not None and t.shape[0] != n.shape[0]):
            want = f"[{'S' if 'first' in name else 'T'}, {width}]"
            raise ValueError(f"{name}: expected {want}, got shape {tuple(t.shape)}")
    if rows.dim() != 2 or rows.dtype.is_floating_point:
        raise ValueError(f"rows: expected [E, L] integer, got {tuple(rows.shape)} {rows.dtype}")
    if overlap and (rows.shape[1] % 2 or width % 2):
        raise ValueError(
            f"overlap: expected an even window and width, got L={rows.shape[1]}, C={width}"
        )
