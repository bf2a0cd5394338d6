"""Cases for sparse_mqa_sink: index lists with ``-1`` holes, duplicated and unsorted entries,
rows that see only their window, rows that see nothing, bf16 / fp32 / FP8-cache KV, and KV
handed as three sources (rows listed in each, a source of another dtype, a row-strided one)."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.formats import PackedRows, RowFormat
from deepinfer.kernels.testing import Case, register, tolerance

FP8 = torch.float8_e4m3fn


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


def split_sources(kv: torch.Tensor, dtypes=(None, None, None)) -> tuple[torch.Tensor, ...]:
    """``kv`` cut into three sources at ``M / 8`` and ``M / 3`` (so window rows of
    :func:`make_index_lists` fall in the first two and compressed rows in the last two), each
    cast to its entry of ``dtypes`` (None: kept)."""
    cuts = (0, kv.shape[0] // 8, kv.shape[0] // 3, kv.shape[0])
    parts = [kv[a:b] for a, b in zip(cuts, cuts[1:])]
    return tuple(p if d is None else p.to(d) for p, d in zip(parts, dtypes))


def packed_sources(kv: torch.Tensor, formats) -> tuple:
    """:func:`split_sources` with source ``i`` stored as :class:`PackedRows` in ``formats[i]``
    (None: kept float)."""
    from deepinfer.kernels.formats import PackedRows
    from deepinfer.kernels.reference.cache_rows import pack_rows

    parts = split_sources(kv.float())
    return tuple(
        p.to(kv.dtype) if f is None else PackedRows(pack_rows(p, f), f)
        for p, f in zip(parts, formats)
    )


def _inputs(gen, device, *, rows, heads, dim, window, entries, num_kv, dtype, kv_dtype, sources):
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(num_kv, dim, generator=gen)
    kv = kv.to(kv_dtype if kv_dtype is not None else dtype)
    idx = make_index_lists(gen, rows=rows, window=window, entries=entries, num_kv=num_kv)
    sink = torch.randn(heads, generator=gen) * 2.0
    scale = dim**-0.5 * 2.0  # peakier than 1/sqrt(d) so the softmax is far from uniform
    if sources is not None and any(isinstance(s, RowFormat) for s in sources):
        kv = tuple(_to(s, device) for s in packed_sources(kv, sources))
        return (q.to(device), kv, idx.to(device), sink.to(device), scale), {}
    if sources is not None:
        kv = split_sources(kv, sources)
        return (q.to(device), tuple(s.to(device) for s in kv), idx.to(device),
                sink.to(device), scale), {}  # fmt: skip
    return (q.to(device), kv.to(device), idx.to(device), sink.to(device), scale), {}


def _to(source, device):
    if isinstance(source, PackedRows):
        return PackedRows(source.data.to(device), source.fmt)
    return source.to(device)


def _row_strided(t: torch.Tensor) -> torch.Tensor:
    wide = torch.empty(t.shape[0], t.shape[1] + 16, dtype=t.dtype, device=t.device)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


def _strided(args):
    q, kv, idx, sink, scale = args
    if not isinstance(kv, torch.Tensor):
        kv = (kv[0], _row_strided(kv[1]), kv[2])
    wide = torch.empty(q.shape[0], q.shape[1], q.shape[2] * 2, dtype=q.dtype, device=q.device)
    wide[..., : q.shape[2]] = q
    wide_idx = torch.full((idx.shape[0], idx.shape[1] + 8), -1, dtype=idx.dtype, device=idx.device)
    wide_idx[:, : idx.shape[1]] = idx
    return (wide[..., : q.shape[2]], kv, wide_idx[:, : idx.shape[1]], sink, scale)


def _source_name(source) -> str:
    if isinstance(source, RowFormat):
        return f"-{source.code}x{source.block}{source.scale}"
    return "-fp8" if source == FP8 else ""


def _case(scale, rows, heads, dim, window, entries, num_kv, dtype, kv_dtype=None, sources=None):
    """``sources``: the dtypes of three KV sources (None: one tensor)."""
    atol, rtol = tolerance(dtype)
    kv_name = "" if kv_dtype is None else "-kvfp8"
    if sources is not None:
        kv_name += "-3src" + "".join(_source_name(d) for d in sources)
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
            sources=sources,
        ),
        make_strided=_strided,
        atol=atol,
        rtol=rtol,
    )


# cache formats at the small cases' width 64 (the real ones in cases.cache_rows)
KV64 = RowFormat(64, 48, "e4m3", 16, "ue8m0")  # V4-like: FP8 head, bf16 tail
KV64_F32 = RowFormat(64, 48, "e4m3", 16, "ue8m0", torch.float32)
ENTRY64 = RowFormat(64, 64, "e2m1", 16, "e4m3")  # V4.1 latents
FP8_ROWS64 = RowFormat(64, 64, "e4m3", 32, "ue8m0")  # V4.1 window
V4_KV = RowFormat(512, 448, "e4m3", 64, "ue8m0")
V41_KV = RowFormat(512, 512, "e4m3", 32, "ue8m0")
V41_ENTRY = RowFormat(512, 512, "e2m1", 16, "e4m3")

register(
    _case("small", 1, 16, 64, 8, 24, 100, torch.float32),
    _case("small", 5, 16, 64, 16, 40, 300, torch.bfloat16),
    _case("small", 4, 20, 48, 8, 56, 200, torch.float32),
    _case("small", 3, 16, 64, 8, 40, 120, torch.bfloat16, FP8),
    _case("small", 4, 16, 64, 16, 40, 300, torch.float32, sources=(None, None, None)),
    _case("small", 5, 16, 64, 16, 40, 300, torch.bfloat16, sources=(FP8, None, FP8)),
    _case("small", 4, 16, 64, 16, 40, 300, torch.bfloat16, sources=(KV64, None, ENTRY64)),
    _case("small", 3, 16, 64, 8, 24, 200, torch.float32, sources=(FP8_ROWS64, None, KV64_F32)),
    _case("real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16),
    _case("real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16, FP8),
    _case("real", 7, 64, 512, 128, 512, 4096, torch.float32),
    _case("real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16, sources=(FP8, None, FP8)),
    _case(
        "real", 64, 64, 512, 128, 512, 131072 + 128, torch.bfloat16, sources=(V4_KV, None, V4_KV)
    ),
    _case("real", 64, 64, 512, 128, 512, 65536, torch.bfloat16, sources=(V41_KV, None, V41_ENTRY)),
    _case("real", 1024, 64, 512, 128, 512, 65536, torch.bfloat16),
)


def _join_inputs(gen, device, *, rows, first, second, dtypes):
    """Two index lists with ~30% ``-1`` holes and an offset past both."""
    lists = []
    for n, dtype in zip((first, second), dtypes, strict=True):
        t = torch.randint(0, 5000, (rows, n), generator=gen)
        t[torch.rand(rows, n, generator=gen) < 0.3] = -1
        lists.append(t.to(device, dtype))
    return (*lists, int(torch.randint(1, 10**6, (1,), generator=gen))), {}


register(
    *(
        Case("join_index_lists", f"{rows}x{first}+{second}-{a}-{b}".replace("torch.", ""), scale,
             functools.partial(_join_inputs, rows=rows, first=first, second=second,
                               dtypes=(a, b)), atol=0, rtol=0)
        for scale, rows, first, second in (
            ("small", 3, 8, 5), ("small", 1, 0, 7), ("small", 4, 6, 0), ("small", 9, 130, 70),
            ("real", 64, 128, 512), ("real", 8192, 128, 512),
        )
        for a, b in ((torch.int32, torch.int64), (torch.int64, torch.int32))
    ),
)  # fmt: skip
