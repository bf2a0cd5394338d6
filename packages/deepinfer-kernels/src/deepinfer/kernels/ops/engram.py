"""Engram (DeepSeek-V4.1 conditional memory): n-gram hashing, FP8 table lookup, gating.

Spec: deepseek-v4.md section 7.3. The engine builds, per token, the window of the last
``N = max_ngram_size`` compressed token ids (barriers already replaced by the pad id's compressed
id), hashes it into table rows with :func:`engram_hash`, reads the rows with
:func:`engram_embedding_lookup`, projects them with ``engram.wkv`` and mixes the result into the
hyper-connection streams with :func:`engram_gate`.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import engram as ref
from deepinfer.kernels.registry import op

__all__ = ["engram_hash", "engram_embedding_lookup", "engram_gate"]


@op(reference=ref.engram_hash)
def engram_hash(
    ngram_ids: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Table row ids of every n-gram (orders 2..N) and head, for ``L`` Engram layers at once.

    ngram_ids:   ``[T, N]`` int64, column ``k`` = compressed id of the token ``k`` positions back
                 (column 0 = the token itself); values in ``[0, compressed_vocab)``.
    multipliers: ``[L, N]`` int64, odd, each ``< int64_max / compressed_vocab`` (no overflow).
    primes:      ``[L, (N-1)*H]`` int64, the table size of each (order, head) column; columns are
                 ordered order-major (order 2 heads 0..H-1, then order 3, ...).
    offsets:     ``[L, (N-1)*H]`` int64, first row of each column's range in the layer's table.
    Returns ``[T, L, (N-1)*H]`` int64: with ``p_k = ngram_ids[:, k] * multipliers[l, k]`` and
    ``x_n = p_0 ^ p_1 ^ ... ^ p_{n-1}`` (bitwise xor), column ``(n-2)*H + j`` is
    ``x_n mod primes[l, col] + offsets[l, col]``. Exact integer arithmetic.
    """


@op(reference=ref.engram_embedding_lookup)
def engram_embedding_lookup(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    row_ids: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Gather table rows and dequantise them: ``out[..., e] = w[r, e] * s[r, e // 32]``.

    weight:  ``[R, E]`` float8_e4m3fn (the checkpoint's ``engram.embed.weight``), or any float
             dtype for an unquantised table (then ``scale`` is None).
    scale:   ``[R, E // 32]`` float8_e8m0fnu (power-of-two, bias 127), or None.
    row_ids: ``[...]`` int64 in ``[0, R)``.
    Returns ``[..., E]`` of ``out_dtype``: products formed in fp32, rounded once.
    """


@op(reference=ref.engram_gate)
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
    """Gate the Engram value into each hyper-connection stream.

    hidden:   ``[T, nc, D]`` the streams (bf16 or fp32, any strides).
    key:      ``[T, nc, D]`` one key per stream; value: ``[T, D]``.
    q_weight, k_weight: ``[nc, D]`` (``engram.q_weight`` / ``engram.k_weight``, bf16).
    mask:     ``[T]`` bool; False rows (image tokens) pass through bit-identical.
    In fp32, per (token t, stream j):
    ``dot = sum_d h*q_w*k_w*key * rsqrt(mean(h^2)+eps) * rsqrt(mean(key^2)+eps) * D^-0.5``,
    ``g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))`` (``dot == +0`` counts as positive),
    ``out = h + g * value`` rounded once to ``hidden.dtype``.
    out: optional ``[T, nc, D]`` destination of ``hidden.dtype``; returned.
    """
