"""Cases for engram_hash, engram_embedding_lookup and engram_gate."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance

SMALL_PRIMES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069)


def _hash_inputs(gen, device, *, tokens, ngram, layers, heads, vocab, primes):
    ids = torch.randint(0, vocab, (tokens, ngram), generator=gen)
    bound = (2**63 - 1) // vocab // 2
    mult = torch.randint(0, bound, (layers, ngram), generator=gen) * 2 + 1
    cols = (ngram - 1) * heads
    if primes is None:  # real-size tables: ~16M-row columns
        p = torch.randint(15_000_000, 17_000_000, (layers, cols), generator=gen) | 1
    else:
        pick = torch.randint(0, len(primes), (layers, cols), generator=gen)
        p = torch.tensor(primes)[pick]
    offsets = torch.cumsum(torch.cat([torch.zeros(layers, 1, dtype=torch.long), p[:, :-1]], 1), 1)
    return tuple(t.to(device) for t in (ids, mult, p, offsets)), {}


def _strided_first(args):
    ids = args[0]
    wide = torch.zeros(ids.shape[0], ids.shape[1] * 2, dtype=ids.dtype, device=ids.device)
    wide[:, ::2] = ids
    return (wide[:, ::2], *args[1:])


def _random_fp8_table(gen, rows, width, device):
    weight = (torch.randn(rows, width, generator=gen) * 2.0).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 135, (rows, width // 32), generator=gen, dtype=torch.uint8)
    return weight.to(device), exponents.view(torch.float8_e8m0fnu).to(device)


def _lookup_inputs(gen, device, *, rows, width, ids_shape, out_dtype, quantized):
    if quantized:
        weight, scale = _random_fp8_table(gen, rows, width, device)
    else:
        weight, scale = torch.randn(rows, width, generator=gen).to(device), None
    row_ids = torch.randint(0, rows, ids_shape, generator=gen).to(device)
    return (weight, scale, row_ids), {"out_dtype": out_dtype}


def _strided_ids(args):
    weight, scale, ids = args
    wide = torch.zeros(*ids.shape[:-1], ids.shape[-1] * 2, dtype=ids.dtype, device=ids.device)
    wide[..., ::2] = ids
    return (weight, scale, wide[..., ::2])


def _gate_inputs(gen, device, *, tokens, streams, dim, dtype):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    hidden, key, value = (
        randn(tokens, streams, dim),
        randn(tokens, streams, dim),
        randn(tokens, dim),
    )
    q_weight = (torch.rand(streams, dim, generator=gen) + 0.5).bfloat16().to(device)
    k_weight = (torch.rand(streams, dim, generator=gen) + 0.5).bfloat16().to(device)
    mask = (torch.rand(tokens, generator=gen) > 0.25).to(device)
    return (hidden, key, value, q_weight, k_weight, mask, 1e-6), {}


def _strided_hidden(args):
    hidden = args[0]
    wide = torch.randn(hidden.shape[0], hidden.shape[1], hidden.shape[2] + 16).to(hidden)
    wide[..., : hidden.shape[2]] = hidden
    return (wide[..., : hidden.shape[2]], *args[1:])


def _hash_cases(scale, shapes):
    cases = []
    for tokens, ngram, layers, heads, vocab, primes in shapes:
        cases.append(
            Case(
                op="engram_hash",
                name=f"{tokens}t-{ngram}gram-{layers}l-{heads}h",
                scale=scale,
                make_inputs=functools.partial(
                    _hash_inputs,
                    tokens=tokens,
                    ngram=ngram,
                    layers=layers,
                    heads=heads,
                    vocab=vocab,
                    primes=primes,
                ),
                make_strided=_strided_first,
                atol=0,
                rtol=0,
            )
        )
    return cases


def _lookup_cases(scale, shapes):
    cases = []
    for rows, width, ids_shape, quantized in shapes:
        for out_dtype in (torch.bfloat16, torch.float32):
            kind = "fp8" if quantized else "float"
            cases.append(
                Case(
                    op="engram_embedding_lookup",
                    name=f"{kind}-{rows}x{width}-{'x'.join(map(str, ids_shape))}-"
                    f"{str(out_dtype).removeprefix('torch.')}",
                    scale=scale,
                    make_inputs=functools.partial(
                        _lookup_inputs,
                        rows=rows,
                        width=width,
                        ids_shape=ids_shape,
                        out_dtype=out_dtype,
                        quantized=quantized,
                    ),
                    make_strided=_strided_ids,
                    atol=0,
                    rtol=0,
                )
            )
    return cases


def _gate_cases(scale, shapes, dtypes):
    cases = []
    for tokens, streams, dim in shapes:
        for dtype in dtypes:
            atol, rtol = tolerance(dtype)
            cases.append(
                Case(
                    op="engram_gate",
                    name=f"{tokens}x{streams}x{dim}-{str(dtype).removeprefix('torch.')}",
                    scale=scale,
                    make_inputs=functools.partial(
                        _gate_inputs, tokens=tokens, streams=streams, dim=dim, dtype=dtype
                    ),
                    out_names=("out",),
                    make_strided=_strided_hidden,
                    atol=atol,
                    rtol=rtol,
                )
            )
    return cases


register(
    *_hash_cases("small", [(1, 2, 1, 1, 50, SMALL_PRIMES), (37, 4, 2, 3, 997, SMALL_PRIMES)]),
    *_hash_cases("real", [(1, 4, 2, 8, 99092, None), (8192, 4, 2, 8, 99092, None)]),
    *_lookup_cases("small", [(50, 64, (7, 3), True), (20, 32, (5,), False)]),
    *_lookup_cases("real", [(200_000, 256, (4096, 24), True), (200_000, 256, (1, 24), True)]),
    *_gate_cases("small", [(1, 4, 64), (9, 2, 96)], [torch.float32, torch.bfloat16]),
    *_gate_cases("real", [(1, 4, 5120), (4096, 4, 5120)], [torch.bfloat16, torch.float32]),
)
