"""Cases for select_topk, candidate_block_mask and hadamard_rotate (the indexer's own ops;
indexer_scores has its cases in indexer_extra.py)."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance


def _visible_lists(gen, rows, width, device):
    """Per-row visible counts 0..width (row 0 sees nothing), arena rows in entry order."""
    counts = torch.randint(0, width + 1, (rows,), generator=gen)
    counts[0] = 0
    arena = torch.randperm(4 * width + 7, generator=gen)[:width]
    cols = torch.arange(width)
    candidates = torch.where(cols < counts[:, None], arena[cols].expand(rows, -1), -1)
    return counts.to(device), candidates.to(device)


def _scores(gen, candidates):
    scores = torch.randn(candidates.shape, generator=gen).to(candidates.device)
    return scores.masked_fill(candidates < 0, float("-inf"))


def _topk_inputs(gen, device, *, rows, width, k):
    _, candidates = _visible_lists(gen, rows, width, device)
    return (_scores(gen, candidates), candidates, k), {}


def _candidate_inputs(gen, device, *, rows, width, blocks, block_size):
    counts, candidates = _visible_lists(gen, rows, width, device)
    return (_scores(gen, candidates), counts, blocks, block_size), {}


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
