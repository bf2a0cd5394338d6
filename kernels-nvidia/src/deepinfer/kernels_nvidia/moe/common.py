"""Triton pieces shared by the routed-expert kernels: the wait that keeps a K loop's upcast off
the registers of wgmmas still in flight, the hidden-row store of the bf16-activation families,
and the combine of each token's expert outputs.

Rows arrive grouped by expert in ``BLOCK_M`` blocks (``align.align_by_expert``):
``block_expert[b]`` names block ``b``'s expert (-1: unused block) and ``row_slot[r]`` the flat
(token, slot) index ``t * k + j`` of row ``r`` (``num_slots``: padding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels_nvidia.quant import pow2_scale, to_bf16, to_e4m3


@triton.jit
def wgmma_fence(x):
    """Wait until every wgmma this warpgroup issued has completed (``wgmma.wait_group 0``);
    returns ``x``. At the top of a K loop it keeps the next step's register upcast from
    overwriting the operands of wgmmas still in flight: Triton 3.6's sm_90 code leaves them in
    flight across the loop's back-edge for some shapes (triton-lang/triton#9433), which gave
    wrong rows on the H200."""
    return tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;\n mov.b32 $0, $1;", "=r,r",
                                     [x], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def store_hidden_dequantised(
    h_ptr, hidden, rows, col0, stride_hm,
    OUT_GROUP: tl.constexpr, SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store bf16 ``q * s``: bf16(hidden) through its FP8 round trip per ``OUT_GROUP`` columns
    (0: none), exact in bf16, so the down GEMM reads plain bf16 rows."""
    hidden = to_bf16(hidden, SOFT_ROUND).to(tl.float32)
    if OUT_GROUP > 0:
        grouped = tl.reshape(hidden, (BLOCK_M, BLOCK_N // OUT_GROUP, OUT_GROUP))
        scale = pow2_scale(tl.max(tl.abs(grouped), axis=2), 1e-4, 448.0)
        q = to_e4m3(grouped / scale[:, :, None], SOFT_ROUND).to(tl.float32)
        hidden = tl.reshape(q * scale[:, :, None], (BLOCK_M, BLOCK_N))
    cols = col0 + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], hidden.to(tl.bfloat16))


@triton.jit
def moe_combine_kernel(
    y_ptr, shared_ptr, out_ptr, N, stride_shared, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
    SHARED: tl.constexpr, SOFT_ROUND: tl.constexpr,
):  # fmt: skip
    """``out[t] = ((y[t, 0] + y[t, 1]) + ...) + y[t, k-1]`` in fp32, slot order, then
    ``+ shared[t]`` (``SHARED``), stored in ``out``'s dtype (fp32, or bf16 rounded to nearest
    even)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(y_ptr + token * TOP_K * N + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * N + cols, mask=mask, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(shared_ptr + token * stride_shared + cols, mask=mask).to(tl.float32)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + token * N + cols, to_bf16(acc, SOFT_ROUND), mask=mask)
    else:
        tl.store(out_ptr + token * N + cols, acc, mask=mask)
