"""Reference sampling ops: token-bitmask masking, the top-k/top-p/min-p cutoff, seeded Gumbel draw.

Random numbers come from :mod:`deepinfer.kernels.counter_hash`, the hash
``deepinfer.sampling.rng`` uses too.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import counter_hash


def gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, stream: int, num: int
) -> torch.Tensor:
    """``-log(-log(u))`` float32 ``[B, num]``, u the 24-bit hash uniform of (seed, pos, stream, j)."""
    counters = torch.arange(num, device=seeds.device, dtype=torch.int64)
    u = counter_hash.uniform24(counter_hash.hash64(seeds, positions, stream, counters))
    return -torch.log(-torch.log(u))


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    vocab = logits.shape[-1]
    bit = torch.arange(vocab, device=logits.device)
    words = bitmask.to(logits.device)[:, bit // 32]
    allowed = ((words >> (bit % 32)) & 1).bool()
    masked = logits.masked_fill(~allowed, float("-inf"))
    if out is None:
        return masked
    out.copy_(masked)
    return out


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits * (1 / temperature)`` in float32: the values every sampling op compares."""
    inv = 1.0 / temperature.to(device=logits.device, dtype=torch.float32)
    return logits.float() * inv[:, None]


def top_k_top_p_min_p_cutoff(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    s = scaled_logits(logits, temperature)
    vocab = s.shape[-1]
    sorted_s, _ = torch.sort(s, dim=-1, descending=True)
    m = sorted_s[:, :1]
    e = torch.exp(sorted_s - m)
    k = top_k.to(device=s.device, dtype=torch.int64)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    # top-k: keep x iff fewer than k values are strictly greater (ties at the cut are kept).
    t_k = sorted_s.gather(1, (k - 1)[:, None])
    in_k = sorted_s >= t_k
    # mass strictly above each sorted value (equal values share the mass above the run)
    e_k = torch.where(in_k, e, 0.0)
    z_k = e_k.sum(-1, keepdim=True)
    inclusive = torch.cumsum(e_k, dim=-1)
    first_of_run = torch.searchsorted(-sorted_s, -sorted_s, right=False)
    above = torch.where(first_of_run > 0, inclusive.gather(1, (first_of_run - 1).clamp(min=0)), 0.0)
    p = top_p.to(device=s.device, dtype=torch.float32)[:, None]
    in_p = (above < p * z_k) | (p >= 1.0)
    in_min_p = e >= min_p.to(device=s.device, dtype=torch.float32)[:, None]
    keep = in_k & in_p & in_min_p
    cutoff = torch.where(keep, sorted_s, float("inf")).amin(-1)
    all_kept = keep.all(-1)
    return torch.where(all_kept, torch.full_like(cutoff, float("-inf")), cutoff)


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
) -> torch.Tensor:
    s = scaled_logits(logits, temperature)
    noise = gumbel_noise(seeds.to(s.device), positions.to(s.device), stream, s.shape[-1])
    score = s + noise
    kept = (s >= cutoff.to(s.device)[:, None]) & (s > float("-inf"))
    score = torch.where(kept, score, float("-inf"))
    return torch.argmax(score, dim=-1)
