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


# ``exp`` as a fixed sequence of float32 operations (no FMA, no library call), so every backend
# computes the same bits: Cody-Waite reduction ``x = n ln2 + r`` then a degree-7 Taylor polynomial
# in Horner form, scaled by ``2**n`` through the exponent bits. Constants are exact float32 values.
EXP_FLOOR = -87.0  # below this exp(x) < 2**-125: defined as 0 (and -inf maps to 0)
LOG2E = 1.4426950216293335
LN2_HI = 0.693359375  # few mantissa bits: n * LN2_HI is exact
LN2_LO = -0.00021219444170128554
EXP_COEFFS = (  # 1/7!, 1/6!, ..., 1/1!, 1/0! rounded to float32
    0.00019841270113829523,
    0.0013888889225199819,
    0.008333333767950535,
    0.0416666679084301,
    0.1666666716337204,
    0.5,
    1.0,
    1.0,
)
MASS_SCALE = 2.0**40  # masses are sums of int64 ``trunc(e * 2**40)``: exact, order independent


def exp_nonpositive(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for float32 ``x <= 0`` (relative error ~2e-7), bit-identical on every backend:
    one IEEE float32 operation per step, each rounded. ``x < -87`` (and ``-inf``) gives 0."""
    xc = x.clamp(min=EXP_FLOOR)
    n = torch.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HI) - n * LN2_LO
    poly = torch.full_like(r, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        poly = poly * r + c
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < EXP_FLOOR, 0.0, poly * scale)


def fixed_mass(e: torch.Tensor) -> torch.Tensor:
    """int64 ``trunc(e * 2**40)`` of float32 probabilities-to-the-max ``e`` in [0, 1]."""
    return (e * MASS_SCALE).to(torch.int64)


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
    e = exp_nonpositive(sorted_s - m)
    k = top_k.to(device=s.device, dtype=torch.int64)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    # top-k: keep x iff fewer than k values are strictly greater (ties at the cut are kept).
    t_k = sorted_s.gather(1, (k - 1)[:, None])
    in_k = sorted_s >= t_k
    # exact int64 mass strictly above each sorted value (equal values share the mass above)
    e_k = torch.where(in_k, fixed_mass(e), 0)
    z_k = e_k.sum(-1, keepdim=True)
    inclusive = torch.cumsum(e_k, dim=-1)
    first_of_run = torch.searchsorted(-sorted_s, -sorted_s, right=False)
    above = torch.where(first_of_run > 0, inclusive.gather(1, (first_of_run - 1).clamp(min=0)), 0)
    p = top_p.to(device=s.device, dtype=torch.float32)[:, None]
    in_p = (above.double() < p.double() * z_k.double()) | (p >= 1.0)
    # min-p keeps a suffix too: every value at or above the smallest one with e >= min_p
    mp = min_p.to(device=s.device, dtype=torch.float32)[:, None]
    t_mp = torch.where(e >= mp, sorted_s, float("inf")).amin(-1, keepdim=True)
    keep = in_k & in_p & (sorted_s >= t_mp)
    cutoff = torch.where(keep, sorted_s, float("inf")).amin(-1)
    all_kept = keep.all(-1) | (m[:, 0] == float("-inf"))  # no finite value: nothing to cut
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


def top_k_top_p_min_p_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    cutoff = top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p)
    return gumbel_sample(logits, temperature, cutoff, seeds, positions, stream), cutoff
