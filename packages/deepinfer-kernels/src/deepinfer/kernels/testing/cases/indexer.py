"""Cases for the indexer's ops: indexer_scores (per-sequence candidate lists with holes,
duplicated and unsorted candidates, queries seeing prefixes of growing length, bf16 / fp32 /
FP8 keys), select_topk, candidate_block_mask and hadamard_rotate."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance
from deepinfer.kernels.testing.selection import compare_select_topk

SCORES_TOL = 1e-4  # fp32 accumulation in another order


def make_candidates(gen, *, rows, width, num_keys):
    """``[rows, width]`` int32 unsorted rows of keys with duplicates, holes, trailing padding
    (row r sees a prefix of growing length, like causal visibility), the last row empty."""
    cand = torch.randint(0, num_keys, (rows, width), generator=gen)
    if width > 1:
        cand[:, 1] = cand[:, 0]
    cand[torch.rand(cand.shape, generator=gen) < 0.1] = -1
    visible = torch.linspace(width // 3, width, rows).long()
    cand[torch.arange(width)[None, :] >= visible[:, None]] = -1
    if rows >= 3:
        cand[-1] = -1
    return cand.to(torch.int32)


def per_row(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seq_rows, q_seq, counts)`` giving each query row ``t`` the list ``candidates[t]``
    ``[T, C]``: every row its own sequence, every column counted."""
    rows, width = candidates.shape
    q_seq = torch.arange(rows, device=candidates.device)
    return candidates, q_seq, torch.full_like(q_seq, width)


def make_sequences(gen, *, rows, width, num_keys, sequences):
    """``(seq_rows [sequences, width] int32, q_seq [rows], counts [rows])``: unsorted lists of
    keys with duplicates and holes; each query sees a prefix of its sequence's (counts from
    about a third of the width to all of it and past it, like causal visibility), the last
    query none."""
    seq_rows = torch.randint(0, num_keys, (sequences, width), generator=gen)
    if width > 1:
        seq_rows[:, 1] = seq_rows[:, 0]
    seq_rows[torch.rand(seq_rows.shape, generator=gen) < 0.1] = -1
    q_seq = torch.randint(0, sequences, (rows,), generator=gen)
    counts = torch.linspace(width // 3, width + 2, rows).long()
    if rows >= 3:
        counts[-1] = 0
    return seq_rows.to(torch.int32), q_seq, counts


def _scores_inputs(gen, device, *, rows, heads, dim, width, num_keys, dtype, key_dtype):
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(rows, heads, generator=gen) * (dim * heads) ** -0.5
    keys = torch.randn(num_keys, dim, generator=gen).to(key_dtype or dtype)
    lists = make_sequences(gen, rows=rows, width=width, num_keys=num_keys,
                           sequences=max(1, rows // 2))  # fmt: skip
    return tuple(x.to(device) for x in (q, weights, keys, *lists)), {}


def _strided_scores(args):
    q, weights, keys, seq_rows, q_seq, counts = args
    wide = torch.empty(*q.shape[:2], q.shape[2] + 16, dtype=q.dtype, device=q.device)
    wide[..., : q.shape[2]] = q
    rows = torch.empty(seq_rows.shape[0], 2 * seq_rows.shape[1], dtype=seq_rows.dtype,
                       device=seq_rows.device)[:, ::2]  # fmt: skip
    rows.copy_(seq_rows)
    return (wide[..., : q.shape[2]], weights.t().contiguous().t(), keys, rows, q_seq, counts)


def _scores_case(scale, rows, heads, dim, width, num_keys, dtype, key_dtype=None):
    keys = "" if key_dtype is None else "-keysfp8"
    return Case(
        op="indexer_scores",
        name=f"{rows}x{heads}x{dim}-{width}of{num_keys}-{str(dtype).removeprefix('torch.')}{keys}",
        scale=scale,
        make_inputs=functools.partial(
            _scores_inputs,
            rows=rows,
            heads=heads,
            dim=dim,
            width=width,
            num_keys=num_keys,
            dtype=dtype,
            key_dtype=key_dtype,
        ),  # fmt: skip
        make_strided=_strided_scores,
        atol=SCORES_TOL,
        rtol=SCORES_TOL,
    )


FP8 = torch.float8_e4m3fn

register(
    _scores_case("small", 1, 16, 32, 50, 80, torch.float32),
    _scores_case("small", 5, 16, 64, 130, 300, torch.bfloat16),
    _scores_case("small", 4, 24, 32, 70, 90, torch.bfloat16, FP8),
    _scores_case("real", 64, 64, 128, 16384, 16384, torch.bfloat16),
    _scores_case("real", 64, 64, 128, 16384, 16384, torch.bfloat16, FP8),
    _scores_case("real", 64, 32, 128, 32768, 32768, torch.bfloat16),
    _scores_case("real", 7, 64, 128, 4096, 8192, torch.float32),
)


def _visible_lists(gen, rows, width, device):
    """Per-row visible counts 0..width (row 0 sees nothing); distinct arena rows in entry
    order of up to three sequences ``[B, width]``, and each row's sequence."""
    counts = torch.randint(0, width + 1, (rows,), generator=gen)
    counts[0] = 0
    sequences = min(3, rows)
    arena = torch.randperm(4 * width * sequences + 7, generator=gen)[: width * sequences]
    q_seq = torch.randint(0, sequences, (rows,), generator=gen)
    return counts.to(device), arena.view(sequences, width).to(device), q_seq.to(device)


def _scores(gen, counts, width):
    scores = torch.randn(len(counts), width, generator=gen).to(counts.device)
    hidden = torch.arange(width, device=counts.device) >= counts[:, None]
    return scores.masked_fill(hidden, float("-inf"))


def _topk_inputs(gen, device, *, rows, width, k):
    counts, seq_rows, q_seq = _visible_lists(gen, rows, width, device)
    return (_scores(gen, counts, width), seq_rows, q_seq, k), {}


def _candidate_inputs(gen, device, *, rows, width, blocks, block_size):
    counts, _, _ = _visible_lists(gen, rows, width, device)
    return (_scores(gen, counts, width), counts, blocks, block_size), {}


def _hadamard_inputs(gen, device, *, rows, dim, dtype):
    return ((torch.randn(rows, 3, dim, generator=gen) * 2).to(dtype).to(device),), {}


def _strided_rows(args):
    x = args[0]
    wide = torch.empty(x.shape[0], x.shape[1], 2 * x.shape[2], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return (wide[..., ::2], *args[1:])


def _cases(scale, topk_shapes, cand_shapes, hadamard_shapes):
    cases = []
    for rows, width, k in topk_shapes:
        cases.append(
            Case(
                "select_topk",
                f"{rows}x{width}-k{k}",
                scale,
                functools.partial(_topk_inputs, rows=rows, width=width, k=k),
                atol=0,
                rtol=0,
                compare=compare_select_topk,
            )
        )
    for rows, width, blocks, bs in cand_shapes:
        make = functools.partial(
            _candidate_inputs, rows=rows, width=width, blocks=blocks, block_size=bs
        )
        cases.append(
            Case(
                "candidate_block_mask",
                f"{rows}x{width}-b{blocks}x{bs}",
                scale,
                make,
                atol=0,
                rtol=0,
            )
        )
    for rows, dim in hadamard_shapes:
        for dtype in (torch.float32, torch.bfloat16):
            atol, rtol = tolerance(dtype)
            make = functools.partial(_hadamard_inputs, rows=rows, dim=dim, dtype=dtype)
            cases.append(
                Case(
                    "hadamard_rotate",
                    f"{rows}x{dim}-{str(dtype)[6:]}",
                    scale,
                    make,
                    make_strided=_strided_rows,
                    atol=atol,
                    rtol=rtol,
                )
            )
    return cases


register(
    *_cases("small", [(5, 12, 4), (9, 3, 8)], [(6, 21, 2, 4), (4, 8, 5, 8)], [(4, 16), (3, 128)]),
    *_cases(
        "real",
        [(64, 8192, 512), (512, 2048, 512)],
        [(64, 65536, 2048, 8), (16, 4096, 2048, 8)],
        [(4096, 128)],
    ),
)
