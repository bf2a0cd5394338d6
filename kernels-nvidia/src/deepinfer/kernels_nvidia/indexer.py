"""Lightning-indexer scoring in Triton, and top-k selection.

Scoring: one program per (query row, block of ``BLOCK_C`` candidates) gathers the candidate key
rows once and multiplies all ``Hi`` indexer heads of the row against them in one matrix product
(``[Hi, d] x [d, BLOCK_C]``), then applies ReLU and the per-head weights and reduces over heads
in registers: the ``[T, Hi, C]`` dot products never reach memory. Keys may be stored in the
queries' dtype, fp32, or ``float8_e4m3fn`` (upcast in registers).

Selection: one program per row holds the row's scores in registers, finds the k-th largest by
a 32-step binary search on the order-preserving integer image of the fp32 bits (a count per
step), then writes the winners' positions through a prefix sum; only the k winners are then
sorted (descending, as the contract asks). Rows wider than ``TOPK_MAX_CANDIDATES`` use
``torch.topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.registry import implements

BLOCK_C = 64


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, cand_ptr, out_ptr,
    num_heads, head_dim, num_cand,
    stride_qt, stride_qh, stride_wt, stride_k, stride_ct, stride_ot,
    HB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    heads = tl.arange(0, HB)
    hmask = heads < num_heads
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < head_dim
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + dcols[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + row * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    cand = tl.load(cand_ptr + row * stride_ct + offs, mask=offs < num_cand, other=-1)
    valid = cand >= 0
    keys = tl.load(
        keys_ptr + cand.to(tl.int64)[:, None] * stride_k + dcols[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    ).to(q.dtype)
    if IEEE:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(keys))
    scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    scores = tl.where(valid, scores, float("-inf"))
    tl.store(out_ptr + row * stride_ot + offs, scores, mask=offs < num_cand)


def _check(q, weights, keys, candidates):
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hi, d], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if weights.shape != (t, h):
        raise ValueError(f"weights: expected shape {(t, h)}, got {tuple(weights.shape)}")
    if keys.dim() != 2 or keys.shape[1] != d:
        raise ValueError(f"keys: expected [M, {d}], got shape {tuple(keys.shape)}")
    if candidates.dim() != 2 or candidates.shape[0] != t:
        raise ValueError(f"candidates: expected [{t}, C], got shape {tuple(candidates.shape)}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@implements("indexer_scores")
def indexer_scores(q, weights, keys, candidates):
    _check(q, weights, keys, candidates)
    if torch.float32 in (q.dtype, keys.dtype) or q.dtype not in (torch.bfloat16, torch.float16):
        q = q.float()  # compute in fp32 whenever either side is fp32 (as the reference does)
    q, keys, candidates = _unit_last(q), _unit_last(keys), _unit_last(candidates)
    weights = _unit_last(weights)
    t, h, d = q.shape
    num_cand = candidates.shape[1]
    out = torch.empty(t, num_cand, dtype=torch.float32, device=q.device)
    if t == 0 or num_cand == 0:
        return out
    grid = (t, triton.cdiv(num_cand, BLOCK_C))
    _indexer_scores_kernel[grid](
        q, weights, keys, candidates, out, h, d, num_cand,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), candidates.stride(0),
        out.stride(0),
        HB=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_C=BLOCK_C, IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out


TOPK_MAX_CANDIDATES = 16384  # widest row the register-resident top-k kernel takes


@triton.jit
def _ordered_key(scores):
    """uint32 keys in the order of the fp32 ``scores``; 0 for ``-inf`` / NaN (never chosen)."""
    scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 ties with +0.0, as in torch.sort
    bits = scores.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = (signed ^ -2147483648).to(tl.uint32, bitcast=True)
    return tl.where(scores > float("-inf"), key, 0)


@triton.jit
def _topk_kernel(
    scores_ptr, out_ptr, num_cand, k, stride_st, stride_ot,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program per row: binary search on the key bits for the k-th largest score, then a
    prefix sum writes the winners' column positions in column order (ties at the threshold:
    lowest columns first; ``-1`` pads)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    scores = tl.load(scores_ptr + row * stride_st + offs, mask=offs < num_cand, other=-float("inf"))
    key = _ordered_key(scores)
    num_valid = tl.sum((key > 0).to(tl.int32), axis=0)
    want = tl.minimum(num_valid, k)
    lo = tl.full([], 0, tl.int64)  # invariant: count(key >= lo) >= want
    hi = tl.full([], 4294967295, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        count = tl.sum((key >= mid.to(tl.uint32)).to(tl.int32), axis=0)
        lo = tl.where(count >= want, mid, lo)
        hi = tl.where(count >= want, hi, mid - 1)
    threshold = lo.to(tl.uint32)
    above = key > threshold
    num_above = tl.sum(above.to(tl.int32), axis=0)
    slot = tl.cumsum(above.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_ot + slot, offs, mask=above)
    tied = (key == threshold) & (key > 0)  # the places left go to ties in position order
    slot = num_above + tl.cumsum(tied.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_ot + slot, offs, mask=tied & (slot < want))
    tail = tl.arange(0, BLOCK_K)
    pad = (tail >= want) & (tail < k)
    tl.store(out_ptr + row * stride_ot + tail, tl.full([BLOCK_K], -1, tl.int32), mask=pad)


def _topk_torch(scores, candidates, k):
    """Wide rows: a stable descending sort (ties by column, like the kernel)."""
    width = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = order.values[..., :width], order.indices[..., :width]
    picked = candidates.long().gather(-1, indices)
    picked = picked.masked_fill(~torch.isfinite(values), -1)
    if width < k:
        picked = torch.nn.functional.pad(picked, (0, k - width), value=-1)
    return picked


@implements("select_topk")
def select_topk(scores, candidates, k):
    """Rows up to ``TOPK_MAX_CANDIDATES`` wide: the Triton selection, then a sort of the k
    winners by score (the contract wants descending order); wider rows: ``torch.topk``.
    ``+inf`` / NaN scores are not expected (the scores are finite or ``-inf``)."""
    if scores.shape != candidates.shape or scores.dim() != 2:
        raise ValueError(
            f"candidates: expected shape {tuple(scores.shape)}, got {tuple(candidates.shape)}"
        )
    rows, width = scores.shape
    if width > TOPK_MAX_CANDIDATES or scores.dtype != torch.float32:
        return _topk_torch(scores, candidates, k)
    if rows == 0 or k == 0:
        return torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    positions = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    block_c = triton.next_power_of_2(max(width, 16))
    _topk_kernel[(rows,)](
        scores, positions, width, k, scores.stride(0), positions.stride(0),
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(k),
        num_warps=min(16, max(4, block_c // 1024)),
    )  # fmt: skip
    # Only the k winners are sorted (descending score, the contract's order; the kernel wrote
    # them in column order, so a stable sort breaks ties by column); pads sort last.
    valid = positions >= 0
    columns = positions.long().clamp(min=0)
    won = scores.gather(-1, columns).masked_fill(~valid, float("-inf"))
    order = won.sort(dim=-1, descending=True, stable=True).indices  # ties: lower column first
    columns, valid = columns.gather(-1, order), valid.gather(-1, order)
    return candidates.gather(-1, columns).long().masked_fill(~valid, -1)


@triton.jit
def _hadamard_block(rows_idx, cols_idx):
    """Sylvester Hadamard entries ``(-1) ** popcount(i & j)`` for an [i-block, j-block]."""
    bits = rows_idx[:, None] & cols_idx[None, :]
    bits ^= bits >> 16
    bits ^= bits >> 8
    bits ^= bits >> 4
    bits ^= bits >> 2
    bits ^= bits >> 1
    return 1.0 - 2.0 * (bits & 1).to(tl.float32)


@triton.jit
def _hadamard_kernel(
    x_ptr, out_ptr, num_rows, dim, stride_x, stride_o, scale,
    BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """out[rows, n-block] = x[rows] @ H[:, n-block] * scale, H built on the fly (exact +-1)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < num_rows
    acc = tl.zeros([BR, BN], tl.float32)
    for k0 in range(0, dim, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
            mask=rmask[:, None] & (ks < dim)[None, :],
            other=0.0,
        )
        h = _hadamard_block(ks, cols).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, h, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, h, acc)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
        (acc * scale).to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & (cols < dim)[None, :],
    )


@implements("hadamard_rotate")
def hadamard_rotate(x):
    """Normalised Walsh-Hadamard transform of the last dim as a product with the +-1 matrix,
    generated in registers (exact in bf16 and fp32 operands; fp32 accumulation)."""
    dim = x.shape[-1]
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"x: the last dim must be a power of two, got {dim}")
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    compute = x2 if x2.dtype in (torch.bfloat16, torch.float16) else x2.float()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(x.shape)
    block = max(16, min(64, dim))
    grid = (triton.cdiv(x2.shape[0], 16), triton.cdiv(dim, block))
    _hadamard_kernel[grid](
        compute, out, x2.shape[0], dim, compute.stride(0), out.stride(0), dim**-0.5,
        BR=16, BN=block, BK=block, IEEE=compute.dtype == torch.float32,
        num_warps=8 if compute.dtype == torch.float32 else 4,
    )  # fmt: skip
    return out.view(x.shape)
