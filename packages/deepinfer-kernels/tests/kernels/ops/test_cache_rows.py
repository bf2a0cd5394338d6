"""Cache rows in the model's formats: packing then unpacking is the reference rounding bit for
bit, and attention / the indexer read packed rows as the same values in float."""

from __future__ import annotations

import pytest
import torch

import deepinfer.kernels as K
from deepinfer.kernels.testing.cases.cache_rows import (
    FORMATS,
    INDEX_KEY,
    V4_KV,
    V41_ENTRY,
    V41_KV,
    random_rows,
)
from deepinfer.kernels.testing.cases.indexer import per_row

ROUNDINGS = {
    "v4kv": lambda x: torch.cat([K.fp8_sim(x[..., :448], 64), x[..., 448:]], dim=-1),
    "v41kv": lambda x: K.fp8_sim(x, 32),
    "v41entry": lambda x: K.fp4_sim(x, 16, scale_fmt="e4m3"),
    "index": lambda x: K.fp4_sim(x, 32),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unpacked_rows_are_the_reference_rounding(name, dtype):
    fmt = FORMATS[name]
    fmt = K.RowFormat(fmt.dim, fmt.quantised, fmt.code, fmt.block, fmt.scale, dtype)
    x = random_rows(torch.Generator().manual_seed(1), 64, fmt.dim, dtype)
    packed = K.pack_rows(x, fmt)
    assert packed.shape == (64, fmt.row_bytes) and packed.dtype == torch.uint8
    assert torch.equal(K.unpack_rows(packed, fmt, dtype), ROUNDINGS[name](x))


def test_pow2_formats_repack_rounded_rows_exactly():
    """The stored bytes of rounded rows dequantise to the same values (writers may pack what
    the model rounded)."""
    x = random_rows(torch.Generator().manual_seed(2), 64, 512, torch.bfloat16)
    for fmt, name in ((V4_KV, "v4kv"), (V41_KV, "v41kv")):
        rounded = ROUNDINGS[name](x)
        assert torch.equal(K.unpack_rows(K.pack_rows(rounded, fmt), fmt, torch.bfloat16), rounded)


def test_row_bytes_of_the_model_formats():
    assert (V4_KV.row_bytes, V41_KV.row_bytes, V41_ENTRY.row_bytes) == (592, 528, 288)
    assert INDEX_KEY.row_bytes == 80


def test_readers_see_packed_rows_as_their_values():
    g = torch.Generator().manual_seed(3)
    fmt = K.RowFormat(64, 48, "e4m3", 16, "ue8m0")
    window, step, arena = (random_rows(g, n, 64) for n in (30, 5, 50))
    packed = [K.PackedRows(K.pack_rows(t, fmt), fmt) for t in (window, arena)]
    floats = [K.unpack_rows(p.data, fmt) for p in packed]
    q, sink = torch.randn(5, 4, 64, generator=g), torch.randn(4, generator=g)
    idx = torch.randint(-1, 85, (5, 20), generator=g)
    want = K.sparse_mqa_sink(q, (floats[0], step, floats[1]), idx, sink, 0.2)
    got = K.sparse_mqa_sink(q, (packed[0], step, packed[1]), idx, sink, 0.2)
    assert torch.equal(got, want)
    keys = K.PackedRows(K.pack_rows(random_rows(g, 40, 128), INDEX_KEY), INDEX_KEY)
    qi, w = torch.randn(5, 2, 128, generator=g), torch.randn(5, 2, generator=g)
    cand = torch.randint(-1, 40, (5, 12), generator=g)
    want = K.indexer_scores(qi, w, K.unpack_rows(keys.data, INDEX_KEY), *per_row(cand))
    assert torch.equal(K.indexer_scores(qi, w, keys, *per_row(cand)), want)


def test_bad_formats_and_rows_are_named():
    with pytest.raises(ValueError, match="RowFormat.block"):
        K.RowFormat(64, 48, "e4m3", 20, "ue8m0")
    with pytest.raises(ValueError, match="RowFormat.code"):
        K.RowFormat(64, 64, "int8", 16, "ue8m0")
    with pytest.raises(ValueError, match=r"x: expected \[..., 512\]"):
        K.pack_rows(torch.zeros(2, 64), V4_KV)
    with pytest.raises(ValueError, match="PackedRows.data"):
        K.PackedRows(torch.zeros(2, 64, dtype=torch.uint8), V4_KV)
