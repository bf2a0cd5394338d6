"""Sampling ops: grammar-mask apply, the top-k/top-p/min-p cutoff and the seeded Gumbel draw.

The boundaries are chosen so a device never writes a full ``[B, V]`` matrix it does not need:
the truncation op returns one cutoff value per row (every filter keeps a suffix of the sorted
values, so "keep" is ``scaled >= cutoff``), and the draw op reads the logits once, applying
temperature, cutoff and noise in registers.

Scaled logits are ``logits.float() * (1 / temperature)`` with the reciprocal computed in float32
by torch before launch, so every backend compares the same values.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import sampling as ref
from deepinfer.kernels.registry import op

__all__ = [
    "apply_token_bitmask",
    "gumbel_sample",
    "top_k_top_p_min_p_cutoff",
    "top_k_top_p_min_p_sample",
]


@op(reference=ref.apply_token_bitmask)
def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` with ``-inf`` where bit ``t % 32`` of ``bitmask[b, t // 32]`` is 0.

    logits:  ``[B, V]`` float32 / bfloat16 / float16, unit column stride.
    out:     optional ``[B, V]`` of ``logits.dtype`` to write into (``out=logits`` masks in
             place); returned.
    bitmask: ``[B, W]`` int32 with ``W >= ceil(V / 32)`` (xgrammar's layout: bit j of word w
             allows token ``32 * w + j``); bits past ``V`` are ignored. An all-ones row (-1)
             leaves its logits untouched. May live on the host; it is copied to the logits'
             device.
    """


@op(reference=ref.top_k_top_p_min_p_cutoff)
def top_k_top_p_min_p_cutoff(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Per row, the smallest scaled logit that survives top-k, then top-p, then min-p.

    logits:      ``[B, V]`` float32 (or bf16/fp16, read as float32); ``-inf`` = masked token.
    temperature: ``[B]`` float32 > 0; values compared are ``s = logits * (1 / temperature)``.
    top_k:       ``[B]`` int32/int64; ``<= 0`` or ``>= V`` is off. A token is kept if fewer than
                 ``k`` values are strictly greater (ties at the cut are all kept).
    top_p:       ``[B]`` float32 in (0, 1]; 1 is off. Among the top-k survivors with mass
                 ``Z_k``, a token is kept if the mass of survivors strictly greater than it is
                 ``< top_p * Z_k`` (the smallest prefix reaching ``top_p``; ties kept).
    min_p:       ``[B]`` float32 in [0, 1]; keeps every value at or above the smallest value
                 with ``e >= min_p`` (the same set as ``e >= min_p``, ``e`` being monotone).
    Returns ``[B]`` float32: the cutoff ``c`` with kept = ``s >= c``; ``-inf`` when every token
    is kept (and for a row with no finite value).

    Masses are exact, so the result is bit-identical on every backend, for any summation order
    or batch: ``e = exp_nonpositive(s - max(s))`` is a fixed sequence of float32 operations
    (``reference.sampling.exp_nonpositive``: relative error < 3e-7, 0 below -87), each token's
    mass is the int64 ``trunc(e * 2**40)``, masses are summed as integers, and
    ``mass_above < top_p * Z_k`` is compared in float64. There is no tolerance at the top-p
    boundary: conformance is exact equality.
    """


@op(reference=ref.gumbel_sample)
def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
) -> torch.Tensor:
    """Draw one token per row: ``argmax_t (s[b, t] + g[b, t])`` over tokens with ``s >= cutoff``.

    logits:      ``[B, V]`` float32 (or bf16/fp16, read as float32).
    temperature: ``[B]`` float32 > 0; ``s = logits * (1 / temperature)``.
    cutoff:      ``[B]`` float32 from :func:`top_k_top_p_min_p_cutoff` (``-inf`` = keep all).
    seeds, positions: ``[B]`` int64: the request seed and the absolute position of the token
                 being drawn. ``stream``: a small int naming the use (sample, draft, ...).
    g[b, t] = ``-log(-log(u))`` with ``u = (h >> 40 + 0.5) / 2**24`` and ``h`` the 64-bit
    counter hash of (seed, position, stream, t) (``deepinfer.sampling.rng``): a pure function of
    the row, so the draw never depends on the batch or the row's index.
    Returns ``[B]`` int64. Ties go to the lowest index; ``-inf`` logits are never drawn.
    The hash bits are identical on every backend; ``log`` may differ by an ulp across devices,
    which can only change a draw whose two best perturbed scores are within an ulp.
    """


@op(reference=ref.top_k_top_p_min_p_sample)
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
    """:func:`top_k_top_p_min_p_cutoff` then :func:`gumbel_sample` with that cutoff, as one op.

    Arguments as in those two ops. Returns ``(token_ids, cutoff)``: ``[B]`` int64 and ``[B]``
    float32, each exactly what the two ops return (the same tokens bit for bit, under the same
    tie and ``log`` rules). One op so a backend can draw from what the cutoff already gathered
    instead of reading the logits again.
    """
