"""RMSNorm and fused residual-add RMSNorm in Triton.

One program normalises ``ROWS`` rows held whole in registers (hidden sizes up to 16k), reading
and writing each element once: the kernels are bound by HBM bandwidth. The reduction order of a
row depends only on the hidden size and the block size, never on the number of rows, so results
are batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, hidden, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    for r in range(ROWS):
        row = tl.program_id(0) * ROWS + r
        if row < n_rows:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + row64 * stride_res + cols, mask=col_mask, other=0.0)
                summed = (x + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_ptr + row64 * stride_res_out + cols, summed, mask=col_mask)
                x = summed.to(tl.float32)
            mean_sq = tl.sum(x * x, axis=0) / hidden
            y = x * tl.rsqrt(mean_sq + eps) * w
            tl.store(
                out_ptr + row64 * stride_out + cols,
                y.to(out_ptr.dtype.element_ty),
                mask=col_mask,
            )


def _rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """A 2-D ``[rows, H]`` view with unit column stride (copies only if it must)."""
    if t.dim() == 0:
        raise ValueError(f"{name}: expected [..., H], got a scalar")
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _launch(x, residual, weight, eps, out, residual_out):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: expected shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    x2 = _rows_view(x, "x")
    n_rows = x2.shape[0]
    res2 = _rows_view(residual, "residual") if residual is not None else x2
    out_dtype = x.dtype
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
        res_out2 = residual_out.view(-1, hidden)
    else:
        res_out2 = out2
    block = triton.next_power_of_2(hidden)
    rows = 1 if n_rows < 4096 else 4
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    grid = (triton.cdiv(n_rows, rows),)
    _rms_norm_kernel[grid](
        x2, res2, weight.contiguous(), out2, res_out2,
        n_rows, hidden, x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows, num_warps=num_warps,
    )  # fmt: skip
    return out, residual_out


@implements("rms_norm")
def rms_norm(x, weight, eps, *, out=None):
    return _launch(x, None, weight, eps, out, None)[0]


@implements("fused_add_rms_norm")
def fused_add_rms_norm(x, residual, weight, eps, *, out=None, residual_out=None):
    return _launch(x, residual, weight, eps, out, residual_out)
