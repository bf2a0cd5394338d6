"""Cases for sparse_mqa_sink: index lists with ``-1`` holes, duplicated and unsorted entries,
rows that see only their window, rows that see nothing, bf16 / fp32 / FP8-cache KV."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register, tolerance


def make_index_lists(gen, *, rows, window, entries, num_kv, holes=0.15):
    """``[rows, window + entries]`` int32: per row a window block then a compressed block.

    Window slots are drawn from the first ``num_kv // 4`` rows of ``kv`` and compressed slots from
    the rest, unsorted, with duplicates and ``-1`` holes; row 0 sees only its window, and when
    there are three rows or more, the last row sees nothing.
    """
    split = max(1, num_kv // 4)
    win = torch.randint(0, split, (rows, window), generator=gen)
    comp = torch.randint(split, num_kv, (rows, entries), generator=gen)
    if entries > 1:
        comp[:, 1] = comp[:, 0]  # a duplicated entry
    idx = torch.cat([win, comp], dim=1)
    holes_mask = torch.rand(idx.shape, generator=gen) < holes
    idx[holes_mask] = -1
    idx[0, window:] = -1  # window only
    if rows >= 3:
        idx[-1] = -1  # no visible entry: zeros
    return idx.to(torch.int32)


def _inputs(gen, device, *, rows, heads, dim, window, entries, num_kv, dtype, kv_dtype):
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(num_kv, dim, generator=gen)
    kv = kv.to(kv_dtype if kv_dtype is not None else dtype)
    idx = make_index_lists(gen, rows=rows, window=window, entries=entries, num_kv=num_kv)
    sink = torch.randn(heads, generator=gen) * 2.0
    scale = dim**-0.5 * 2.0  # peakier than 1/sqrt(d) so the softmax is far from uniform
    return (q.to(device), kv.to(device), idx.to(device), sink.to(device), scale), {}


def _strided(args):
    q, kv, idx, sink, scale = args
    wide = torch.empty(q.shape[0], q.shape[1], q.shape[2] * 2, dtype=q.dtype, device=q.device)
    wide[..., : q.shape[2]] = q
    wide_idx = torch.full((idx.shape[0], idx.shape[1] + 8), -1, dtype=idx.dtype, device=idx.device)
    wide_idx[:, : idx.shape[1]] = idx
    return (wide[..., : q.shape[2]], kv, wide_idx[:, : idx.shape[1]], sink, scale)


def _case(scale, rows, heads, dim, window, entries, num_kv, dtype, kv_dtype=None):
    atol, rtol = tolerance(dtype)
    kv_name = "" if kv_dtype is None else "-kvfp8"
    return Case(
        op="sparse_mqa_sink",
        name=f"{rows}x{heads}x{dim}-w{window}+{entries}of{num_kv}"
        f"-{str(dtype).removeprefix('torch.')}{kv_name}",
        scale=scale,
        make_inputs=functools.partial(
            _inputs,
            rows=rows,
            heads=heads,
            dim=dim,
            window=window,
            entries=entries,
            num_kv=num_kv,
            dtype=dtype,
            kv_dtype=kv_dtype,
        ),
        make_strided=_strided,
        atol=atol,
        rtol=rtol,
    )


FP8 = torch.float8_e4m3fn

register(
    _case("small", 1, 16, 64, 8, 24, 100, torch.float32),
    _case("small", 5, 16, 64, 16, 40, 300, torch.bfloat16),
    _case("small", 4, 20, 48, 8, 56, 200, torch.float32),
    _case("small", 3, 16, 64, 8, 40, 120, torch.bfloat16, FP8),
    _case("real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16),
    _case("real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16, FP8),
    _case("real", 7, 64, 512, 128, 512, 4096, torch.float32),
    _case("real", 1024, 64, 512, 128, 512, 65536, torch.bfloat16),
)
