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
    kv = _take(first_kv, second_kv, rows)  # no copy of the pool: each row from its source
    score = _take(first_score, second_score, rows).float()
    score.masked_fill_((rows < 0).unsqueeze(-1), float("-inf"))
    if overlap:
        r, d = rows.shape[1] // 2, kv.shape[2] // 2
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
    return compress_pool(kv, score, out_dtype=out_dtype)


def _take(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``torch.cat([first, second])[rows.clamp(min=0)]`` without concatenating (in the two
    sources' promoted dtype)."""
    split, src = first.shape[0], rows.long().clamp(min=0)
    dtype = torch.promote_types(first.dtype, second.dtype)
    if second.shape[0] == 0:
        return first[src.clamp(max=max(split - 1, 0))].to(dtype)
    from_second = second[(src - split).clamp(min=0, max=second.shape[0] - 1)].to(dtype)
    if split == 0:
        return from_second
    from_first = first[src.clamp(max=split - 1)].to(dtype)
    return torch.where((src < split).unsqueeze(-1), from_first, from_second)


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


def write_state_rows(
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    dst: torch.Tensor,
    kv: torch.Tensor,
    score: torch.Tensor,
    src: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_state_rows(state_kv, state_score, dst, kv, score, src)
    dst, src = dst.long(), src.long()
    state_kv.index_copy_(0, dst, kv[src].to(state_kv.dtype))
    state_score.index_copy_(0, dst, score[src].to(state_score.dtype))
    return state_kv, state_score


def check_state_rows(state_kv, state_score, dst, kv, score, src) -> None:
    """The shapes :func:`write_state_rows` takes (ValueError naming the argument)."""
    width = state_kv.shape[-1]
    for name, t in (("state_kv", state_kv), ("state_score", state_score), ("kv", kv),
                    ("score", score)):  # fmt: skip
        if t.dim() != 2 or t.shape[1] != width:
            raise ValueError(f"{name}: expected [rows, {width}], got shape {tuple(t.shape)}")
    if state_score.shape[0] != state_kv.shape[0] or score.shape[0] != kv.shape[0]:
        raise ValueError(
            f"state_score / score: expected {state_kv.shape[0]} / {kv.shape[0]} rows, got "
            f"{state_score.shape[0]} / {score.shape[0]}"
        )
    for name, t in (("dst", dst), ("src", src)):
        if t.dim() != 1 or t.dtype.is_floating_point or t.shape != dst.shape:
            raise ValueError(
                f"{name}: expected integer [{dst.shape[0]}], got {tuple(t.shape)} {t.dtype}"
            )
