"""Reference manifold-constrained hyper-connections (mHC)."""

from __future__ import annotations

import torch


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    # Normalise the flat streams, then project: the fp32 order of the public transformers ports
    # (V4 and V4.1). DeepSeek's V4 inference scales the projection instead, ``(x @ fn^T) * r``:
    # the same value up to one rounding of each mix.
    flat = x.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.float().t()


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
    nc = x.shape[-2]
    m = _mixes(x, fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[:, :nc] * scale[0] + base[:nc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, nc : 2 * nc] * scale[1] + base[nc : 2 * nc])
    comb = (m[:, 2 * nc :] * scale[2] + base[2 * nc :]).unflatten(-1, (nc, nc))
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_head_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    m = _mixes(x, fn, norm_eps)
    return torch.sigmoid(m * scale.float()[0] + base.float()) + hc_eps


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.float().unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


def hc_expand(
    f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), h.float())
    return (post.float().unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(h.dtype)


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
    pre, post, comb = hc_mix_coefficients(
        x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    y = hc_collapse(x, pre if collapse_pre is None else collapse_pre)
    return y, pre, post, comb
