"""Lightning-indexer scoring and the Hadamard rotation in Triton (top-k selection and the
candidate pre-filter live in :mod:`.indexer_topk`).

Scoring: one program per (query row, run of ``BLOCKS`` blocks of ``BLOCK_C`` candidates) loads
the row's ``[Hi, d]`` queries once (its candidates: the first ``counts[t]`` of its sequence's
list, read from the ``[B, C]`` lists in place), then for each block holding a column below
``counts[t]`` gathers the candidate key rows once and multiplies all ``Hi`` indexer heads
against them in one matrix product (``[Hi, d] x [d, BLOCK_C]``), applies ReLU and the per-head
weights and reduces over heads in registers: the ``[T, Hi, C]`` dot products never reach
memory, and the queries are not re-read per block. Blocks wholly past ``counts[t]`` are only
filled with ``-inf`` (no gather, no product); a program whose run starts past it loads nothing.
Keys may be stored in the queries' dtype, fp32, ``float8_e4m3fn`` (upcast in registers), or as
the cache's packed FP4 rows (:class:`~deepinfer.kernels.PackedRows`, decoded in registers by
:mod:`.attention_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import PackedRows
from deepinfer.kernels_nvidia.attention_rows import format_consts, load_source
from deepinfer.kernels_nvidia.registry import implements

# Keys as the product's M side with 64-candidate blocks, 16 per program, 4 warps: faster than
# every heads-as-M launch measured (bench_indexer.py); 32 blocks per program was within noise.
BLOCK_C = 64  # candidates per matrix product
BLOCKS_PER_PROGRAM = 16  # blocks one program walks with its queries resident
SCORE_WARPS = 4


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, rows_ptr, seq_ptr, count_ptr, out_ptr,
    num_heads, head_dim, num_cand, weight_scale,
    stride_qt, stride_qh, stride_wt, stride_k, stride_rs, stride_ot,
    HB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCKS: tl.constexpr,
    IEEE: tl.constexpr, KEYS_AS_M: tl.constexpr, D: tl.constexpr, Q: tl.constexpr,
    BLK: tl.constexpr, FP4: tl.constexpr, E4M3S: tl.constexpr, TSZ: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row * stride_ot
    count = tl.minimum(tl.load(count_ptr + row).to(tl.int64), num_cand)
    first = tl.program_id(1) * (BLOCKS * BLOCK_C)
    # Only blocks holding a column below the count are scored; the rest just get -inf. Early
    # rows of a causal prefill see few columns, so whole programs skip the loads and products.
    live = tl.minimum(tl.maximum(tl.cdiv(count - first, BLOCK_C), 0), BLOCKS).to(tl.int32)
    if live > 0:
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
        w = w * weight_scale  # fp32, as the scaling before the op was
        cand_row = rows_ptr + tl.load(seq_ptr + row).to(tl.int64) * stride_rs
        for b in range(live):  # a dynamic trip count, not a branch per block
            offs = first + b * BLOCK_C + tl.arange(0, BLOCK_C)
            cand = tl.load(cand_row + offs, mask=offs < count, other=-1)
            valid = cand >= 0
            keys = load_source(keys_ptr, stride_k, cand.to(tl.int64), dcols,
                               valid[:, None] & dmask[None, :], q, D, Q, BLK, FP4, E4M3S, TSZ)  # fmt: skip
            if KEYS_AS_M:  # [BLOCK_C, HB]: the head sum runs along N, inside each warp
                if IEEE:
                    dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
                else:
                    dots = tl.dot(keys, tl.trans(q))
                scores = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
            else:  # [HB, BLOCK_C]
                if IEEE:
                    dots = tl.dot(q, tl.trans(keys), input_precision="ieee")
                else:
                    dots = tl.dot(q, tl.trans(keys))
                scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
            scores = tl.where(valid, scores, float("-inf"))
            tl.store(out_row + offs, scores, mask=offs < num_cand)
    hole = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for b in range(live, BLOCKS):  # wholly past the count: the value a masked column gets
        offs = first + b * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(out_row + offs, hole, mask=offs < num_cand)


def _check(q, weights, keys, seq_rows, q_seq, counts):
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hi, d], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if weights.shape != (t, h):
        raise ValueError(f"weights: expected shape {(t, h)}, got {tuple(weights.shape)}")
    if keys.dim() != 2 or keys.shape[1] != d:
        raise ValueError(f"keys: expected [M, {d}], got shape {tuple(keys.shape)}")
    if seq_rows.dim() != 2:
        raise ValueError(f"seq_rows: expected [B, C], got shape {tuple(seq_rows.shape)}")
    for name, x in (("q_seq", q_seq), ("counts", counts)):
        if x.shape != (t,):
            raise ValueError(f"{name}: expected shape {(t,)}, got {tuple(x.shape)}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@implements("indexer_scores")
def indexer_scores(
    q,
    weights,
    keys,
    seq_rows,
    q_seq,
    counts,
    *,
    weight_scale=1.0,
    block_c=None,
    blocks_per_program=None,
    num_warps=None,
    num_stages=None,
    keys_as_m=None,
):
    """See :func:`deepinfer.kernels.indexer_scores`; the keywords override the launch
    (benchmark sweeps). A score never depends on the number of rows or the candidate tiling
    (one dot per candidate). ``keys_as_m`` puts the keys on the product's M side (the head sum
    then runs inside each warp; the default for 16-bit queries, the fastest launch measured);
    it may change the last bits against the heads-as-M orientation, never with the batch."""
    _check(q, weights, keys, seq_rows, q_seq, counts)
    packed = isinstance(keys, PackedRows)
    fp32_keys = not packed and keys.dtype == torch.float32
    if fp32_keys or q.dtype not in (torch.bfloat16, torch.float16):
        q = q.float()  # compute in fp32 whenever either side is fp32 (as the reference does)
    consts = {"D": keys.shape[1], **format_consts(keys, "")}
    keys = keys.data if packed else _unit_last(keys)
    q, seq_rows = _unit_last(q), _unit_last(seq_rows)
    q_seq, counts = q_seq.contiguous(), counts.contiguous()
    weights = _unit_last(weights)
    if keys_as_m is None:
        keys_as_m = q.dtype != torch.float32
    t, h, d = q.shape
    num_cand = seq_rows.shape[1]
    out = torch.empty(t, num_cand, dtype=torch.float32, device=q.device)
    if t == 0 or num_cand == 0:
        return out
    block_c = block_c or BLOCK_C
    blocks = max(1, min(blocks_per_program or BLOCKS_PER_PROGRAM, triton.cdiv(num_cand, block_c)))
    grid = (t, triton.cdiv(num_cand, block_c * blocks))
    _indexer_scores_kernel[grid](
        q, weights, keys, seq_rows, q_seq, counts, out, h, d, num_cand, float(weight_scale),
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), seq_rows.stride(0),
        out.stride(0),
        HB=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_C=block_c, BLOCKS=blocks, IEEE=q.dtype == torch.float32, KEYS_AS_M=keys_as_m,
        **consts,
        num_warps=num_warps or SCORE_WARPS, num_stages=num_stages or 3,
    )  # fmt: skip
    return out


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
