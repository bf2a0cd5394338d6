"""Reference lightning-indexer scoring and top-k selection."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference.cache_rows import rows_of


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_rows: torch.Tensor,
    q_seq: torch.Tensor,
    counts: torch.Tensor,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    q_seq = q_seq.long()
    cols = torch.arange(seq_rows.shape[1], device=seq_rows.device)
    valid = (seq_rows >= 0)[q_seq] & (cols < counts[:, None])
    # each sequence's key rows once, then per query (the same product as a per-query list: a
    # column's score never depends on the other columns)
    k = rows_of(keys, seq_rows.long())[q_seq]  # [T, C, d] fp32 (packed keys dequantised)
    dots = torch.einsum("thd,tcd->thc", q.float(), k).relu()
    scores = torch.einsum("th,thc->tc", weights.float() * weight_scale, dots)
    return scores.masked_fill(~valid, float("-inf"))


def select_topk(
    scores: torch.Tensor, seq_rows: torch.Tensor, q_seq: torch.Tensor, k: int
) -> torch.Tensor:
    # A stable sort breaks ties (equal scores are common after the ReLU) by column, so the
    # choice does not depend on how much padding the batch added after a row's candidates.
    width = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = order.values[..., :width], order.indices[..., :width]
    picked = seq_rows.long()[q_seq.long()[:, None], indices]
    picked = torch.where(torch.isfinite(values), picked, torch.full_like(picked, -1))
    if width < k:
        picked = torch.nn.functional.pad(picked, (0, k - width), value=-1)
    return picked


def candidate_block_mask(
    scores: torch.Tensor, visible_count: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block_size), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block_size)).amax(-1)  # [T, nb]
    newest = ((visible_count - 1) // block_size).unsqueeze(-1)  # -1 when nothing is visible
    ids = torch.arange(blocks.shape[-1], device=scores.device)
    blocks = blocks.masked_fill(ids == newest, float("inf"))
    # Stable: equal block scores keep the earlier block, whatever padding follows the row.
    order = torch.sort(blocks, dim=-1, descending=True, stable=True)
    count = min(topk_blocks, blocks.shape[-1])
    values, indices = order.values[..., :count], order.indices[..., :count]
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    keep.scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :width]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.unflatten(-1, (-1, 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * d**-0.5).reshape(x.shape).to(x.dtype)
