"""Sampling kernels in Triton: grammar-mask apply and the seeded Gumbel draw (the cutoff is in
``sampling_cutoff``).

* ``apply_token_bitmask``: one program per (row, block of tokens); reads each logit once.
* ``gumbel_sample``: the row is split into chunks; each program loads its chunk at once and,
  only if the chunk holds a kept token, derives the row's hash key from (seed, position,
  stream), computes the counter-hash Gumbel noise of its tokens in registers and reduces
  ``argmax(s + g)`` once (lowest index on ties); a second tiny launch (or, fused, the row's
  last program) picks the best chunk (first on ties). No ``[B, V]`` noise is stored.
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
from deepinfer.kernels_nvidia.sampling_cutoff import chunking


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
def row_key(seeds_ptr, positions_ptr, stream_term, row):
    """The row's 64-bit hash key of (seed, position, stream)."""
    seed = tl.load(seeds_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True)
    key = seed * 0x9E3779B97F4A7C15 + position * 0xD6E8FEB86659FD93
    return _mix64(key + stream_term.to(tl.int64).to(tl.uint64, bitcast=True))


@triton.jit
def gumbel_noise(key, cols):
    """``-log(-log(u))`` of token ids ``cols`` (int32), ``u`` the 24-bit hash uniform."""
    z = _mix64(key + (cols.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _pick_chunk(best_ptr, best_idx_ptr, out_ptr, row, num_chunks, NCP: tl.constexpr):
    """The best chunk of a row, the first on ties (so the lowest token id overall)."""
    c = tl.arange(0, NCP)
    mask = c < num_chunks  # .cg: with a fused pick, other programs of the launch stored these
    best = tl.load(
        best_ptr + row * num_chunks + c, mask=mask, other=-float("inf"), cache_modifier=".cg"
    )
    winner = tl.min(tl.where(best == tl.max(best), c, NCP))
    idx = tl.load(best_idx_ptr + row * num_chunks + winner, cache_modifier=".cg")
    tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _row_is_active(flags_ptr, row, ONLY_FLAGGED: tl.constexpr):
    """With ``ONLY_FLAGGED``, only rows whose flag is set are drawn here (the others were drawn
    from the cutoff's candidates)."""
    active = tl.full([], 1, tl.int1)
    if ONLY_FLAGGED:
        active = tl.load(flags_ptr + row) != 0
    return active


@triton.jit
def _gumbel_kernel(
    logits_ptr, stride, temp_ptr, cutoff_ptr, seeds_ptr, positions_ptr, stream_term, best_ptr,
    best_idx_ptr, done_ptr, out_ptr, flags_ptr, vocab, num_chunks,
    CHUNK: tl.constexpr, NCP: tl.constexpr, FUSED: tl.constexpr, ONLY_FLAGGED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if _row_is_active(flags_ptr, row, ONLY_FLAGGED):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = cols < vocab
        inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row))
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        s = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        kept = (s >= tl.load(cutoff_ptr + row)) & (s > float("-inf")) & inside
        best = tl.full([], float("-inf"), tl.float32)
        best_idx = (chunk * CHUNK).to(tl.int32)
        if tl.max(kept.to(tl.int32)) > 0:  # only chunks holding a kept token pay for the noise
            key = row_key(seeds_ptr, positions_ptr, stream_term, row)
            score = tl.where(kept, s + gumbel_noise(key, cols), float("-inf"))
            best = tl.max(score)
            best_idx = tl.min(tl.where(score == best, cols, 2147483647))
        tl.store(best_ptr + row * num_chunks + chunk, best)
        tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)
        if FUSED:  # the row's last program to get here picks its chunk
            tl.debug_barrier()
            if tl.atomic_add(done_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
                _pick_chunk(best_ptr, best_idx_ptr, out_ptr, row, num_chunks, NCP)


@triton.jit
def _pick_chunk_kernel(
    best_ptr, best_idx_ptr, out_ptr, flags_ptr, num_chunks, NCP: tl.constexpr,
    ONLY_FLAGGED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if _row_is_active(flags_ptr, row, ONLY_FLAGGED):
        _pick_chunk(best_ptr, best_idx_ptr, out_ptr, row, num_chunks, NCP)


def gumbel(logits, temperature, cutoff, seeds, positions, stream, *, fused_pick: bool = False,
           out=None, only_rows_flagged=None):  # fmt: skip
    """:func:`deepinfer.kernels.gumbel_sample`; ``fused_pick``: the last chunk program of each
    row picks its best chunk (one launch less, one tiny zero-fill more). ``out``: the ``[B]``
    int64 result to write; ``only_rows_flagged``: a ``[B]`` int32 flag per row, nonzero for
    the rows to draw (the others' ``out`` entries are left as they are)."""
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
    chunk, num_chunks = chunking(vocab)
    ncp = 1 << max(0, num_chunks - 1).bit_length()
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    done = torch.zeros(rows, dtype=torch.int32, device=device) if fused_pick else best_idx
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    flagged = only_rows_flagged is not None
    flags = only_rows_flagged if flagged else best_idx
    _gumbel_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperature, cutoff, seeds, positions, stream_term(stream),
        best, best_idx, done, out, flags, vocab, num_chunks, CHUNK=chunk, NCP=ncp,
        FUSED=fused_pick, ONLY_FLAGGED=flagged, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    if not fused_pick:
        _pick_chunk_kernel[(rows,)](
            best, best_idx, out, flags, num_chunks, NCP=ncp, ONLY_FLAGGED=flagged, num_warps=1
        )
    return out


@implements("gumbel_sample")
def gumbel_sample(logits, temperature, cutoff, seeds, positions, stream):
    return gumbel(logits, temperature, cutoff, seeds, positions, stream)
