"""The routed experts of an MoE layer as one op: FP4 (e2m1 + ue8m0) expert weights."""

from __future__ import annotations

import torch

from deepinfer.kernels.reference import moe_kernels as ref
from deepinfer.kernels.registry import op

__all__ = ["fp4_moe_experts"]


@op(reference=ref.fp4_moe_experts)
def fp4_moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    swiglu_limit: float,
    act_quant_group: int | None,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sum over a token's routed experts of ``w2_e(bf16(swiglu(w1_e x, w3_e x) * w_router))``.

    x:            ``[T, D]`` bf16 (or fp32) expert input.
    topk_weights: ``[T, k]`` fp32 router weights; topk_ids ``[T, k]`` int32/int64 in ``[0, E)``.
    w13:          ``[E, 2I, D/2]`` int8 packed e2m1 (nibble order as :func:`fp4_dequant`):
                  rows ``0..I-1`` are ``w1`` (gate), rows ``I..2I-1`` are ``w3`` (up).
    w13_scale:    ``[E, 2I, D/32]`` ``float8_e8m0fnu`` (or ``uint8``).
    w2:           ``[E, D, I/2]`` int8 packed e2m1; w2_scale ``[E, D, I/32]`` e8m0.
    swiglu_limit: ``L`` in ``silu(min(g, L)) * clamp(u, -L, L)``.
    act_quant_group: the reference's FP8 input quantisation of both expert linears (spec 4.3)
                  per that many elements along K (128 in V4, 32 in V4.1); ``None`` skips it.
    Per (token t, slot j) with expert ``e = topk_ids[t, j]``: ``g, u = w1_e q(x_t), w3_e q(x_t)``
    (fp32), ``a = bf16(silu(min(g, L)) * clamp(u, -L, L) * topk_weights[t, j])``,
    ``y_j = bf16(w2_e q(a))``; returns fp32 ``[T, D]`` = ``((y_0 + y_1) + ...) + y_{k-1}``
    summed in slot order in fp32 (``q`` = FP8 round trip per group, or identity).
    shared:       optional ``[T, D]`` rows (the shared expert's output, any float dtype) added
                  to that fp32 sum, widened exactly.
    out_dtype:    the result's dtype: the fp32 sum (plus ``shared``) rounded once.
    """
