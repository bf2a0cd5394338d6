"""Manifold-constrained hyper-connections: coefficients (with Sinkhorn), collapse, expand."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import hc as ref
from deepinfer.kernels.registry import op

__all__ = [
    "hc_mix_coefficients",
    "hc_head_coefficients",
    "hc_collapse",
    "hc_expand",
    "hc_pre",
]


@op(reference=ref.hc_mix_coefficients)
def hc_mix_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (pre, post, comb) mixing weights of one mHC site, per token, all fp32.

    x:     ``[T, nc, D]`` the residual streams (any float dtype).
    fn:    ``[(2 + nc) * nc, nc * D]`` fp32; base ``[(2 + nc) * nc]`` fp32; scale ``[3]`` fp32.
    ``m = (flat(x) * rsqrt(mean(flat(x)^2) + norm_eps)) @ fn^T`` (the reference normalises
    first, as the public transformers ports do; scaling the projection instead differs by one
    rounding);
    ``pre = sigmoid(m[:nc] s0 + b) + hc_eps``; ``post = 2 sigmoid(m[nc:2nc] s1 + b)``;
    ``comb = softmax_k(m[2nc:] s2 + b as [j, k]) + hc_eps``, then a column normalisation
    (``/ (sum_j + hc_eps)``) and ``sinkhorn_iters - 1`` rounds of row then column
    normalisation. Returns pre ``[T, nc]``, post ``[T, nc]``, comb ``[T, nc, nc]``.
    """


@op(reference=ref.hc_head_coefficients)
def hc_head_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Final stream-collapse weights (V4 ``hc_head``): ``sigmoid(m s + b) + hc_eps``.

    x: ``[T, nc, D]``; fn ``[nc, nc * D]``, base ``[nc]``, scale ``[1]`` fp32; ``m`` as in
    :func:`hc_mix_coefficients`. Returns ``[T, nc]`` fp32.
    """


@op(reference=ref.hc_collapse)
def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``y = sum_j pre[j] h[j]``: h ``[T, nc, D]``, pre ``[T, nc]`` fp32; fp32 sum, returns
    ``[T, D]`` of ``h.dtype``."""


@op(reference=ref.hc_expand)
def hc_expand(
    f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``h_new[k] = post[k] f + sum_j comb[j, k] h[j]`` (the sum runs over comb's FIRST index).

    f ``[T, D]`` sublayer output; h ``[T, nc, D]`` the streams before the sublayer;
    post ``[T, nc]`` and comb ``[T, nc, nc]`` fp32. Computed in fp32, returns ``[T, nc, D]`` of
    ``h.dtype``.
    """


@op(reference=ref.hc_pre)
def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    collapse_pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC pre site: :func:`hc_mix_coefficients` of ``x`` and the collapse of ``x``, fused
    (one pass over the streams where the backend can).

    x ``[T, nc, D]`` (bf16 / fp16 / fp32); fn, base, scale and the eps / iteration arguments as
    in :func:`hc_mix_coefficients`. The collapse weights are this site's ``pre`` (V4), or
    ``collapse_pre [T, nc]`` fp32 when given (V4.1's deferred pre-mix: the previous site's
    weights collapse these streams). Returns ``(y [T, D] of x.dtype, pre [T, nc], post [T, nc],
    comb [T, nc, nc])``, the weights fp32: ``y = hc_collapse(x, collapse_pre or pre)``.
    """
