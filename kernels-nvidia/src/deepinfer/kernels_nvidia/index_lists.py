"""``join_index_lists`` in one launch: attention's window lists and its compressed entries'
rows (moved past the window and step sources) as one ``[T, A + B]`` list, instead of a
compare, an add, a select and a concatenation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference.attention import check_index_lists
from deepinfer.kernels_nvidia.registry import implements


@triton.jit(do_not_specialize=["offset"])  # one compile for every offset
def _join_kernel(
    first_ptr, second_ptr, out_ptr, n_first, n_second, offset,
    stride_f, stride_s, stride_o, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_first = cols < n_first
    in_second = (cols >= n_first) & (cols < n_first + n_second)
    a = tl.load(first_ptr + t * stride_f + cols, mask=in_first, other=0).to(tl.int64)
    b = tl.load(second_ptr + t * stride_s + (cols - n_first), mask=in_second, other=0)
    b = b.to(tl.int64)
    b = tl.where(b >= 0, b + offset, b)
    out = tl.where(in_first, a, b).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + cols, out, mask=in_first | in_second)


@implements("join_index_lists")
def join_index_lists(first: torch.Tensor, second: torch.Tensor, offset: int) -> torch.Tensor:
    check_index_lists(first, second)
    rows, width = first.shape[0], first.shape[1] + second.shape[1]
    out = torch.empty(rows, width, dtype=first.dtype, device=first.device)
    if rows == 0 or width == 0:
        return out
    first = first if first.stride(-1) == 1 else first.contiguous()
    second = second if second.stride(-1) == 1 else second.contiguous()
    block = min(1024, triton.next_power_of_2(width))
    _join_kernel[(rows, triton.cdiv(width, block))](
        first, second, out, first.shape[1], second.shape[1], int(offset),
        first.stride(0), second.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
