"""Reference Engram ops: n-gram hashing, FP8 table lookup, stream gating (plain torch)."""

from __future__ import annotations

import torch

FP8_SCALE_BLOCK = 32


def engram_hash(
    ngram_ids: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    num_ngram = ngram_ids.shape[-1]
    num_layers, num_cols = primes.shape
    heads = num_cols // (num_ngram - 1)
    # products fit in int64 by construction of the multipliers (bounded by int64 max / vocab).
    products = ngram_ids.long()[:, None, :] * multipliers.long()[None, :, :]  # [T, L, N]
    mixed = products[..., 0]
    columns = []
    for order in range(1, num_ngram):
        mixed = torch.bitwise_xor(mixed, products[..., order])
        cols = slice((order - 1) * heads, order * heads)
        columns.append(torch.remainder(mixed[..., None], primes[None, :, cols].long()))
    return torch.cat(columns, -1) + offsets.long()[None]


def engram_embedding_lookup(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    row_ids: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    rows = weight[row_ids.reshape(-1).long()].float()  # [n, E]
    if scale is not None:
        scales = scale[row_ids.reshape(-1).long()].float()  # [n, E / 32]
        rows = (rows.unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]).flatten(-2)
    return rows.to(out_dtype).reshape(*row_ids.shape, weight.shape[-1])


def engram_gate(
    hidden: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    mask: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    h = hidden.float()
    k = key.float()
    dim = h.shape[-1]
    inv_rms_h = torch.rsqrt(h.square().mean(-1) + eps)
    inv_rms_k = torch.rsqrt(k.square().mean(-1) + eps)
    weights = q_weight.float() * k_weight.float()  # [nc, D]
    # the two statistics multiply first, as in the public V4.1 port (same fp32 rounding)
    dot = (h * weights * k).sum(-1) * (inv_rms_h * inv_rms_k) * dim**-0.5  # [T, nc]
    # signed square root; the clamp sits on the magnitude, so dot == 0 gives +sqrt(1e-6)
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    mixed = (h + gate[..., None] * value.float()[:, None, :]).to(hidden.dtype)
    result = torch.where(mask.bool()[:, None, None], mixed, hidden)
    if out is None:
        return result
    out.copy_(result)
    return out
