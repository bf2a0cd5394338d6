"""Cases for apply_token_bitmask, top_k_top_p_min_p_cutoff, gumbel_sample and
top_k_top_p_min_p_sample."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register


def _logits(gen, rows, vocab, device, *, ties=False, masked_share=0.1):
    x = torch.randn(rows, vocab, generator=gen) * 3.0
    if ties:  # coarse values so the top-k / top-p cut often falls inside a run of equal values
        x = torch.round(x * 2.0) / 2.0
    masked = torch.rand(rows, vocab, generator=gen) < masked_share
    masked[:, 0] = False  # at least one finite logit per row
    return x.masked_fill(masked, float("-inf")).to(device)


def _filters(gen, rows, vocab, device):
    choices = torch.tensor([0, 1, 3, max(1, vocab // 7), vocab, -1])
    top_k = choices[torch.randint(0, len(choices), (rows,), generator=gen)].to(torch.int32)
    top_p = torch.where(
        torch.rand(rows, generator=gen) < 0.25, 1.0, 0.2 + 0.79 * torch.rand(rows, generator=gen)
    )
    min_p = torch.where(
        torch.rand(rows, generator=gen) < 0.5, 0.0, 0.3 * torch.rand(rows, generator=gen)
    )
    temperature = 0.3 + 1.5 * torch.rand(rows, generator=gen)
    return temperature.to(device), top_k.to(device), top_p.to(device), min_p.to(device)


def _bitmask_inputs(gen, device, *, rows, vocab, dtype):
    words = (vocab + 31) // 32 + 1  # one spare word: bits past V must be ignored
    bits = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64)
    bitmask = bits.to(torch.int32)
    bitmask[0] = -1  # an unconstrained row
    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(dtype).to(device)
    return (logits, bitmask.to(device)), {}


def _cutoff_inputs(gen, device, *, rows, vocab, ties):
    logits = _logits(gen, rows, vocab, device, ties=ties)
    return (logits, *_filters(gen, rows, vocab, device)), {}


def _gumbel_inputs(gen, device, *, rows, vocab, ties):
    logits = _logits(gen, rows, vocab, device, ties=ties)
    temperature, top_k, top_p, min_p = _filters(gen, rows, vocab, device)
    from deepinfer.kernels.reference.sampling import top_k_top_p_min_p_cutoff

    cutoff = top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64).to(device)
    positions = torch.randint(0, 1 << 20, (rows,), generator=gen, dtype=torch.int64).to(device)
    stream = int(torch.randint(0, 4, (1,), generator=gen))
    return (logits, temperature, cutoff, seeds, positions, stream), {}


def _sample_inputs(gen, device, *, rows, vocab, ties):
    logits = _logits(gen, rows, vocab, device, ties=ties)
    filters = _filters(gen, rows, vocab, device)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64).to(device)
    positions = torch.randint(0, 1 << 20, (rows,), generator=gen, dtype=torch.int64).to(device)
    stream = int(torch.randint(0, 4, (1,), generator=gen))
    return (logits, *filters, seeds, positions, stream), {}


def _cases(scale, shapes):
    cases = []
    for rows, vocab in shapes:
        shape = f"{rows}x{vocab}"
        for dtype in (torch.float32, torch.bfloat16):
            cases.append(
                Case(
                    op="apply_token_bitmask",
                    name=f"{shape}-{str(dtype).removeprefix('torch.')}",
                    scale=scale,
                    make_inputs=functools.partial(
                        _bitmask_inputs, rows=rows, vocab=vocab, dtype=dtype
                    ),
                    out_names=("out",),
                    atol=0.0,
                    rtol=0.0,
                )
            )
        for ties in (False, True):
            tag = "ties" if ties else "random"
            kw = dict(rows=rows, vocab=vocab, ties=ties)
            cases.append(
                Case(
                    op="top_k_top_p_min_p_cutoff",
                    name=f"{shape}-{tag}",
                    scale=scale,
                    make_inputs=functools.partial(_cutoff_inputs, **kw),
                    atol=0.0,
                    rtol=0.0,
                )
            )
            cases.append(
                Case(
                    op="top_k_top_p_min_p_sample",
                    name=f"{shape}-{tag}",
                    scale=scale,
                    make_inputs=functools.partial(_sample_inputs, **kw),
                    atol=0.0,
                    rtol=0.0,
                )
            )
            cases.append(
                Case(
                    op="gumbel_sample",
                    name=f"{shape}-{tag}",
                    scale=scale,
                    make_inputs=functools.partial(_gumbel_inputs, **kw),
                    atol=0.0,
                    rtol=0.0,
                )
            )
    return cases


register(
    *_cases("small", [(1, 40), (6, 300), (5, 1100)]),
    *_cases("real", [(1, 129280), (64, 129280), (256, 129280), (7, 1000)]),
)
