"""Cases for compress_pool and compress_gather_pool: the window lengths of V4 (ratio 4
overlapped = 8 rows, ratio 128) and V4.1 (ratios 1, 2), with ``-inf`` slots (``-1`` rows) for
rows that do not exist; and for write_state_rows, the state writes of a step."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance, with_kwargs


def _inputs(gen, device, *, entries, window, dim, dtype):
    kv = torch.randn(entries, window, dim, generator=gen).to(dtype)
    score = torch.randn(entries, window, dim, generator=gen) * 3
    if window > 1:
        missing = torch.rand(entries, window, generator=gen) < 0.3
        missing[:, 0] = False  # each (e, d) keeps a finite score
        score[missing] = float("-inf")
        score[0, : window // 2] = float("-inf")  # first overlapped window: no previous half
        score[0, window // 2] = torch.randn(dim, generator=gen)
    return (kv.to(device), score.to(device)), {}


def _strided(args):
    kv, score = args
    wide = torch.empty(kv.shape[0], kv.shape[1] + 1, kv.shape[2], dtype=kv.dtype, device=kv.device)
    wide[:, 1:] = kv
    return (wide[:, 1:], score)


def _op_cases(op, scale, named_makes, make_strided):
    """Per (name, make) of one shape: a case at 4x the fp32 tolerance; on the small scale the
    last one again with the result rounded to bf16 by the op (one bf16 ulp apart at most)."""
    atol, rtol = tolerance(torch.float32)
    cases = [Case(op, name, scale, make, make_strided=make_strided, atol=4 * atol, rtol=4 * rtol)
             for name, make in named_makes]  # fmt: skip
    if scale == "small":
        name, make = named_makes[-1]
        make = with_kwargs(make, out_dtype=torch.bfloat16)
        cases.append(Case(op, f"{name}-to-bf16", scale, make, atol=1e-2, rtol=8e-3))
    return cases


def _cases(scale, shapes, dtypes):
    cases = []
    for entries, window, dim in shapes:
        named = [(f"{entries}x{window}x{dim}-{str(dtype).removeprefix('torch.')}",
                  functools.partial(_inputs, entries=entries, window=window, dim=dim, dtype=dtype))
                 for dtype in dtypes]  # fmt: skip
        cases += _op_cases("compress_pool", scale, named, _strided)
    return cases


register(
    *_cases(
        "small", [(3, 1, 64), (5, 2, 96), (6, 8, 64), (2, 128, 32)], [torch.float32, torch.bfloat16]
    ),  # fmt: skip
    *_cases(
        "real",
        [(4096, 8, 512), (4096, 8, 128), (64, 128, 512), (8192, 2, 512), (8192, 1, 512)],
        [torch.float32],
    ),  # fmt: skip
)


def _gather_inputs(
    gen, device, *, entries, window, width, pool, step, overlap, dtype, step_dtype=None
):
    """A state pool of ``pool`` rows and ``step`` step rows; each window's slots index both at
    random, ~30% of them missing (-1), slot 0 always present. ``step_dtype``: the step rows'
    kv and scores in it (a model's projections, beside the fp32 state pool)."""
    first_kv = torch.randn(pool, width, generator=gen).to(dtype)
    second_kv = torch.randn(step, width, generator=gen).to(step_dtype or dtype)
    first_score = torch.randn(pool, width, generator=gen) * 3
    second_score = (torch.randn(step, width, generator=gen) * 3).to(step_dtype or torch.float32)
    rows = torch.randint(0, pool + step, (entries, window), generator=gen)
    rows[torch.rand(entries, window, generator=gen) < 0.3] = -1
    rows[:, 0] = torch.randint(0, pool + step, (entries,), generator=gen)
    args = (first_kv, first_score, second_kv, second_score, rows.to(torch.int32))
    return tuple(t.to(device) for t in args), {"overlap": overlap}


def _gather_strided(args):
    """Every row source a column slice of a wider tensor (row stride > width)."""

    def wide(t):
        w = torch.empty(t.shape[0], t.shape[1] + 8, dtype=t.dtype, device=t.device)
        w[:, 8:] = t
        return w[:, 8:]

    *sources, rows = args
    return (*(wide(t) for t in sources), rows)


def _gather_cases(scale, shapes):
    cases = []
    dtypes = (torch.float32, torch.bfloat16) if scale == "small" else (torch.float32,)
    for entries, window, width, pool, step, overlap in shapes:
        shape = f"{entries}x{window}x{width}-pool{pool}-step{step}{'-overlap' if overlap else ''}"
        named = [(f"{shape}-{str(dtype).removeprefix('torch.')}",
                  functools.partial(_gather_inputs, entries=entries, window=window, width=width,
                                    pool=pool, step=step, overlap=overlap, dtype=dtype))
                 for dtype in dtypes]  # fmt: skip
        named.append((f"{shape}-float32-stepbf16",
                      functools.partial(_gather_inputs, entries=entries, window=window,
                                        width=width, pool=pool, step=step, overlap=overlap,
                                        dtype=torch.float32, step_dtype=torch.bfloat16)))  # fmt: skip
        cases += _op_cases("compress_gather_pool", scale, named, _gather_strided)
    return cases


register(
    *_gather_cases(
        "small",
        [
            (3, 1, 64, 0, 5, False),
            (5, 2, 96, 7, 4, False),
            (6, 8, 128, 9, 13, True),
            (2, 128, 32, 40, 200, False),
            (4, 8, 64, 0, 30, True),
        ],
    ),  # fmt: skip
    *_gather_cases(
        "real",
        [
            (1024, 8, 1024, 256, 4096, True),
            (64, 8, 256, 64, 64, True),
            (32, 128, 512, 4096, 4096, False),
            (64, 2, 512, 128, 64, False),
        ],
    ),  # fmt: skip
)


def _state_inputs(gen, device, *, pool, step, kept, width, step_dtype=torch.float32):
    """A state pool and a step's rows (in ``step_dtype``); ``kept`` distinct state rows get
    step rows (any)."""
    args = (
        torch.randn(pool, width, generator=gen),
        torch.randn(pool, width, generator=gen),
        torch.randperm(pool, generator=gen)[:kept],
        torch.randn(step, width, generator=gen).to(step_dtype),
        (torch.randn(step, width, generator=gen) * 3).to(step_dtype),
        torch.randint(0, step, (kept,), generator=gen),
    )
    return tuple(t.to(device) for t in args), {}


register(
    *(
        Case("write_state_rows", f"pool{pool}-step{step}-kept{kept}-w{width}-{tag}", scale,
             functools.partial(_state_inputs, pool=pool, step=step, kept=kept, width=width,
                               step_dtype=dtype),
             writes=(0, 1), atol=0.0, rtol=0.0)
        for scale, pool, step, kept, width in (
            ("small", 12, 5, 4, 64), ("small", 9, 30, 9, 96), ("small", 4, 3, 0, 32),
            ("real", 64 * 136, 8192, 64 * 8, 1024), ("real", 256 * 8, 256, 256, 256),
        )
        for tag, dtype in (("float32", torch.float32), ("stepbf16", torch.bfloat16))
    ),
)  # fmt: skip
