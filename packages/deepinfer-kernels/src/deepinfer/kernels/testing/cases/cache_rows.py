"""Cases for pack_rows / unpack_rows / write_rows: the cache formats of V4 (FP8 nope + wide
RoPE tail) and V4.1 (FP8 rows, FP4 latents with e4m3 scales), the indexer keys (FP4, ue8m0), on
rows whose magnitudes span 1e-6..1e3 (tiny rows exercise the scale floors). Exact: atol = rtol
= 0."""

from __future__ import annotations

import dataclasses
import functools

import torch

from deepinfer.kernels.formats import RowFormat
from deepinfer.kernels.reference.cache_rows import pack_rows
from deepinfer.kernels.testing import Case, register

V4_KV = RowFormat(512, 448, "e4m3", 64, "ue8m0")
V41_KV = RowFormat(512, 512, "e4m3", 32, "ue8m0")
V41_ENTRY = RowFormat(512, 512, "e2m1", 16, "e4m3")
INDEX_KEY = RowFormat(128, 128, "e2m1", 32, "ue8m0")
FORMATS = {"v4kv": V4_KV, "v41kv": V41_KV, "v41entry": V41_ENTRY, "index": INDEX_KEY}


def random_rows(gen, rows: int, dim: int, dtype=torch.float32) -> torch.Tensor:
    magnitude = torch.exp(torch.empty(rows, 1).uniform_(-14, 7, generator=gen))
    return (torch.randn(rows, dim, generator=gen) * magnitude).to(dtype)


def _pack_inputs(gen, device, *, fmt, rows, dtype):
    return (random_rows(gen, rows, fmt.dim, dtype).to(device), fmt), {}


def _unpack_inputs(gen, device, *, fmt, rows, dtype):
    packed = pack_rows(random_rows(gen, rows, fmt.dim), fmt)
    return (packed.to(device), fmt, dtype), {}


def _write_inputs(gen, device, *, fmt, rows, dtype):
    """A cache of random bytes with room for twice the rows, written at distinct random rows."""
    cache = torch.randint(0, 256, (2 * rows + 3, fmt.row_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.randperm(cache.shape[0], generator=gen)[:rows]
    values = random_rows(gen, rows, fmt.dim, dtype)
    return (cache.to(device), dst.to(device), values.to(device), fmt), {}


def _gather_inputs(gen, device, *, fmt, rows, dtype):
    """As :func:`_write_inputs`, the rows gathered from a longer ``values`` by ``src``
    (repeats allowed, as padding rows repeat a source row)."""
    (cache, dst, values, fmt), _ = _write_inputs(gen, device, fmt=fmt, rows=rows, dtype=dtype)
    more = random_rows(gen, rows + 5, fmt.dim, dtype).to(device)
    src = torch.randint(0, more.shape[0], (rows,), generator=gen).to(device, torch.int32)
    return (cache, dst, more, fmt, src), {}


def _strided_values(args):
    cache, dst, values, fmt = args
    wide = torch.cat([values, values], dim=1)
    return cache, dst, wide[:, : fmt.dim], fmt


def _cases(scale: str, rows: int) -> list[Case]:
    cases = []
    for name, fmt in FORMATS.items():
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"{name}-{rows}-{str(dtype).removeprefix('torch.')}"
            for op, maker in (("pack_rows", _pack_inputs), ("unpack_rows", _unpack_inputs)):
                inputs = functools.partial(maker, fmt=fmt, rows=rows, dtype=dtype)
                cases.append(Case(op=op, name=tag, scale=scale, make_inputs=inputs, atol=0, rtol=0))
            inputs = functools.partial(_write_inputs, fmt=fmt, rows=rows, dtype=dtype)
            write = Case(op="write_rows", name=tag, scale=scale, make_inputs=inputs, atol=0, rtol=0)
            cases.append(dataclasses.replace(write, make_strided=_strided_values, writes=(0,)))
            inputs = functools.partial(_gather_inputs, fmt=fmt, rows=rows, dtype=dtype)
            gather = f"{name}-{rows}-gather-{str(dtype).removeprefix('torch.')}"
            cases.append(Case(op="write_rows", name=gather, scale=scale,
                              make_inputs=inputs, atol=0, rtol=0, writes=(0,)))  # fmt: skip
    return cases


register(*_cases("small", 7), *_cases("real", 4096))
