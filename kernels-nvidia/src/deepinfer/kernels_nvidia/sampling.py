"""Sampling kernels in Triton: grammar-mask apply and the seeded Gumbel draw (the cutoff is in
``sampling_cutoff``).

* ``apply_token_bitmask``: one program per (row, block of tokens); reads each logit once.
* ``gumbel_sample``: the row is split into chunks; each program derives the row's hash key from
  (seed, position, stream), computes the counter-hash Gumbel noise of its tokens in registers
  and reduces ``argmax(s + g)`` (lowest index on ties); a second tiny launch picks the best
  chunk (first on ties). No ``[B, V]`` noise is stored, and no torch op runs around the kernels.
All reductions run within a row in an order fixed by the vocabulary size: batch invariant.
FMA contraction is off (``enable_fp_fusion=False``) and ``1 / T`` is an IEEE division
(``div_rn``), so ``logits * (1 / T)`` and ``s + g`` round exactly like the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.counter_hash import stream_term
from deepinfer.kernels_nvidia.registry import implements


@triton.jit
def _bitmask_kernel(
    logits_ptr, bitmask_ptr, out_ptr, vocab, stride_l, stride_b, stride_o, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=0.0)
    words = tl.load(bitmask_ptr + row * stride_b + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    y = tl.where(allowed, x, float("-inf")).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=inside)


@implements("apply_token_bitmask")
def apply_token_bitmask(logits, bitmask, *, out=None):
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask: expected int32 [{rows}, >= {(vocab + 31) // 32}], got "
            f"{bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if logits.stride(-1) != 1:
        raise ValueError("logits: expected unit column stride")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    if out is None:
        out = torch.empty_like(logits)
    block = 1024
    grid = (rows, triton.cdiv(vocab, block))
    _bitmask_kernel[grid](
        logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), out.stride(0),
        BLOCK=block,
    )  # fmt: skip
    return out


def _row_floats(t: torch.Tensor, rows: int, name: str, device) -> torch.Tensor:
    if t.shape != (rows,):
        raise ValueError(f"{name}: expected shape ({rows},), got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.float32).contiguous()


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected [B, V] with unit column stride, got {logits.shape}")


@triton.jit
def _mix64(z):
    """SplitMix64's finaliser on uint64 (``deepinfer.kernels.counter_hash.mix``)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _gumbel_kernel(
    logits_ptr, stride, temp_ptr, cutoff_ptr, seeds_ptr, positions_ptr, stream_term, best_ptr,
    best_idx_ptr, vocab, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row))
    cutoff = tl.load(cutoff_ptr + row)
    seed = tl.load(seeds_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True)
    key = seed * 0x9E3779B97F4A7C15 + position * 0xD6E8FEB86659FD93
    key = _mix64(key + stream_term.to(tl.int64).to(tl.uint64, bitcast=True))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = (chunk * CHUNK).to(tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        z = _mix64(key + (cols.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = s + (-tl.log(-tl.log(u)))
        score = tl.where((s >= cutoff) & (s > float("-inf")) & inside, score, float("-inf"))
        block_best = tl.max(score)
        block_idx = tl.min(tl.where(score == block_best, cols, 2147483647))
        if block_best > best:
            best = block_best
            best_idx = block_idx
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _pick_chunk_kernel(best_ptr, best_idx_ptr, out_ptr, num_chunks, NCP: tl.constexpr):
    """The best chunk of a row, the first on ties (so the lowest token id overall)."""
    row = tl.program_id(0)
    c = tl.arange(0, NCP)
    best = tl.load(best_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    top = tl.max(best)
    winner = tl.min(tl.where(best == top, c, NCP))
    idx = tl.load(best_idx_ptr + row * num_chunks + winner)
    tl.store(out_ptr + row, idx.to(tl.int64))


@implements("gumbel_sample")
def gumbel_sample(logits, temperature, cutoff, seeds, positions, stream):
    _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    temperature = _row_floats(temperature, rows, "temperature", device)
    cutoff = _row_floats(cutoff, rows, "cutoff", device)
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (rows,) or t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: expected integer shape ({rows},), got {t.dtype} {tuple(t.shape)}"
            )
    seeds, positions = seeds.to(device).contiguous(), positions.to(device).contiguous()
    block = min(1024, triton.next_power_of_2(vocab))
    chunk = max(block, min(8192, triton.next_power_of_2(triton.cdiv(vocab, 16))))
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    _gumbel_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperature, cutoff, seeds, positions, stream_term(stream),
        best, best_idx, vocab, num_chunks, CHUNK=chunk, BLOCK=block, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    _pick_chunk_kernel[(rows,)](
        best, best_idx, out, num_chunks, NCP=triton.next_power_of_2(num_chunks), num_warps=1
    )
    return out
