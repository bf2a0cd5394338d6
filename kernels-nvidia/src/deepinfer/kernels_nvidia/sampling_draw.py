"""``top_k_top_p_min_p_sample`` in Triton: the cutoff, then the Gumbel draw from its candidates.

The cutoff's gather pass already collects, per row, an upper set of the row's values that holds
every kept token (``sampling_cutoff``). With their token ids stored beside them, the row's
finishing program reads the cut and then draws ``argmax(s + g)`` over the kept candidates, with
the same counter-hash noise and the same lowest-id tie rule as ``gumbel_sample``: the same token
bit for bit, without reading the logits a fourth time (the whole-row draw was a fifth of the
sampling step at a decode batch's shapes). Rows whose cut did not come from the candidates
(top-k and top-p off, the whole-row search, or no finite value) are flagged and drawn by the
whole-row Gumbel kernel, whose programs for the other rows return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.counter_hash import stream_term
from deepinfer.kernels_nvidia.registry import implements
from deepinfer.kernels_nvidia.sampling import gumbel, gumbel_noise, row_key
from deepinfer.kernels_nvidia.sampling_cutoff import (
    _MAX_CHUNKS,
    DEFAULT_CAP,
    DEFAULT_SORT_CAP,
    NUM_BINS,
    _choose_bins,
    _finish,
    _load_row_params,
    _plan,
    check_filters,
    first_passes,
)

_NO_TOKEN = 2147483647


@triton.jit
def _draw_from_candidates(cand_row_ptr, idx_row_ptr, total, cut, key, CBLOCK: tl.constexpr):
    """The kept candidate (``s >= cut``, finite) with the largest ``s + g``, the lowest token id
    on ties; ``_NO_TOKEN`` when none is kept."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 2147483647, tl.int32)
    for start in range(0, total, CBLOCK):
        j = start + tl.arange(0, CBLOCK)
        valid = j < total
        # .cg: the gather launch wrote these through L2
        s = tl.load(cand_row_ptr + j, mask=valid, other=float("-inf"), cache_modifier=".cg")
        t = tl.load(idx_row_ptr + j, mask=valid, other=0, cache_modifier=".cg")
        kept = valid & (s >= cut) & (s > float("-inf"))
        score = tl.where(kept, s + gumbel_noise(key, t), float("-inf"))
        block_best = tl.max(score)
        block_idx = tl.min(tl.where(kept & (score == block_best), t, 2147483647))
        better = (block_best > best) | ((block_best == best) & (block_idx < best_idx))
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.maximum(best, block_best)
    return best_idx


@triton.jit
def _finish_draw_kernel(
    logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, maxima_ptr, minima_ptr,
    hist_ptr, z_ptr, t_mp_ptr, cand_ptr, idx_ptr, out_ptr, seeds_ptr, positions_ptr,
    stream_term, tokens_ptr, flags_ptr, vocab, num_chunks, sort_limit,
    NB: tl.constexpr, NCP: tl.constexpr, CAP: tl.constexpr, SORT_CAP: tl.constexpr,
    BLOCK: tl.constexpr, CBLOCK: tl.constexpr, NBLK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    inv_t, k, k_on, p, min_p = _load_row_params(
        temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab
    )
    b1, b, c1, total = _choose_bins(hist_ptr, row, k, k_on, p, sort_limit, CAP, NB)
    cut, from_candidates = _finish(
        logits_ptr, stride, cand_ptr, row, vocab, inv_t, k, k_on, p, min_p, maxima_ptr,
        minima_ptr, z_ptr, t_mp_ptr, out_ptr, num_chunks, b1, b, c1, total, sort_limit, NCP, CAP,
        SORT_CAP, BLOCK, CBLOCK, NBLK,
    )  # fmt: skip
    token = tl.full([], 2147483647, tl.int32)
    if from_candidates:
        key = row_key(seeds_ptr, positions_ptr, stream_term, row)
        token = _draw_from_candidates(
            cand_ptr + row.to(tl.int64) * CAP, idx_ptr + row.to(tl.int64) * CAP, total, cut, key,
            CBLOCK,
        )  # fmt: skip
    drawn = token != 2147483647
    tl.store(tokens_ptr + row, token.to(tl.int64), mask=drawn)
    tl.store(flags_ptr + row, (drawn == 0).to(tl.int32))


def _check_draw_inputs(rows: int, seeds: torch.Tensor, positions: torch.Tensor, device):
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (rows,) or t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: expected integer shape ({rows},), got {t.dtype} {tuple(t.shape)}"
            )
    return seeds.to(device).contiguous(), positions.to(device).contiguous()


def cutoff_and_draw(logits, temperature, top_k, top_p, min_p, seeds, positions, stream, *,
                    cap: int = DEFAULT_CAP, sort_cap: int = DEFAULT_SORT_CAP,
                    max_chunks: int = _MAX_CHUNKS):  # fmt: skip
    """:func:`deepinfer.kernels.top_k_top_p_min_p_sample` with the cutoff's tuning knobs
    (``sampling_cutoff.cutoff``): (token ids ``[B]`` int64, cutoffs ``[B]`` float32)."""
    filters = check_filters(logits, temperature, top_k, top_p, min_p)
    rows, vocab = logits.shape
    seeds, positions = _check_draw_inputs(rows, seeds, positions, logits.device)
    passes = first_passes(logits, filters, cap, sort_cap, max_chunks, store_idx=True)
    _, num_chunks, tail = _plan(vocab, cap, sort_cap, max_chunks)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    flags = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _finish_draw_kernel[(rows,)](
        *passes.head, *passes.params, *passes.buffers, passes.cand, passes.idx, passes.out,
        seeds, positions, stream_term(stream), tokens, flags, vocab, num_chunks, sort_cap,
        NB=NUM_BINS, **tail,
    )  # fmt: skip
    gumbel(logits, filters[0], passes.out, seeds, positions, stream, out=tokens,
           only_rows_flagged=flags)  # fmt: skip
    return tokens, passes.out


@implements("top_k_top_p_min_p_sample")
def top_k_top_p_min_p_sample(logits, temperature, top_k, top_p, min_p, seeds, positions, stream):
    return cutoff_and_draw(logits, temperature, top_k, top_p, min_p, seeds, positions, stream)
