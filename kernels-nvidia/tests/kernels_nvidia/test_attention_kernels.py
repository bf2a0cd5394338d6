"""Sparse MQA-with-sink Triton kernel against the reference: conformance kit, both launch
paths (split decode, whole-list prefill), batch invariance, model shapes on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.attention import (
    ENTRY64,
    KV64,
    make_index_lists,
    packed_sources,
    split_sources,
)
from deepinfer.kernels_nvidia import backend
from deepinfer.kernels_nvidia.attention import SPLIT_ROWS_MAX, AttentionTiles, choose_tiles

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
OP = "sparse_mqa_sink"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
reference = kernels.OPS[OP].reference


def _inputs(seed, rows, heads, dim, window, entries, num_kv, dtype=torch.bfloat16, kv_dtype=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(num_kv, dim, generator=g).to(kv_dtype or dtype).to(DEVICE)
    idx = make_index_lists(g, rows=rows, window=window, entries=entries, num_kv=num_kv)
    sink = (torch.randn(heads, generator=g) * 2).to(DEVICE)
    return q, kv, idx.to(DEVICE), sink, dim**-0.5 * 2


def _values(source) -> torch.Tensor:
    """A source as float rows (packed ones unpacked by the reference, as bf16)."""
    if isinstance(source, kernels.PackedRows):
        return kernels.OPS["unpack_rows"].reference(source.data, source.fmt, torch.bfloat16)
    return source


def test_backend_registers_the_attention_kernel():
    assert OP in backend.ops


@pytest.mark.parametrize("case", cases_for([OP], "small"), ids=str)
def test_conformance_small(case):
    check_case(backend.ops[OP], case, DEVICE)


@pytest.mark.parametrize(
    "tiles",
    [
        AttentionTiles(head_block=16, block_n=16, split_size=32),  # several splits per row
        AttentionTiles(head_block=16, block_n=16, split_size=48),  # split not a tile multiple
        AttentionTiles(head_block=16, block_n=16, split_rows_max=0),  # whole-list path
        AttentionTiles(head_block=16, block_n=16, split_rows_max=0, halves=True),
    ],
    ids=["split32", "split48", "prefill", "prefill_halves"],
)
def test_launch_paths_match_reference(tiles):
    """Each launch path matches the reference, and reading three sources in place gives
    bitwise what it gives on their concatenation."""
    q, kv, idx, sink, scale = _inputs(1, 4, 32, 64, 16, 80, 400)
    got = backend.ops[OP](q, kv, idx, sink, scale, tiles=tiles)
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale), atol=1.6e-2, rtol=1.6e-2)
    sources = split_sources(kv)
    assert torch.equal(backend.ops[OP](q, sources, idx, sink, scale, tiles=tiles), got)
    # cache rows in the model's formats decode in the kernel to exactly their values
    packed = packed_sources(kv, (KV64, None, ENTRY64))
    values = [_values(s) for s in packed]
    got = backend.ops[OP](q, packed, idx, sink, scale, tiles=tiles)
    assert torch.equal(got, backend.ops[OP](q, values, idx, sink, scale, tiles=tiles))


def test_tile_policy():
    assert choose_tiles(1, torch.bfloat16, batch_invariant=False)[1]
    assert not choose_tiles(SPLIT_ROWS_MAX + 1, torch.bfloat16, batch_invariant=False)[1]
    assert choose_tiles(4096, torch.bfloat16, batch_invariant=True)[1]


@pytest.mark.parametrize(
    "rows,entries,split", [(1, 640, 16), (1, 128, 16), (8, 128, 16), (8, 640, 64), (32, 640, 128)]
)
def test_small_batches_cut_their_lists_into_enough_splits(rows, entries, split):
    """About SPLIT_PROGRAMS programs (the sizes measured fastest on an H100 for decode lists of
    128-640 entries); batch-invariant launches keep the one fixed size, whatever the batch."""
    tiles, is_split = choose_tiles(rows, torch.bfloat16, batch_invariant=False, entries=entries)
    assert is_split and tiles.split_size == split and tiles.block_n == min(32, split)
    fixed, _ = choose_tiles(rows, torch.bfloat16, batch_invariant=True, entries=entries)
    assert fixed.split_size == 128


def test_short_splits_match_the_reference():
    """The default policy at one row over a long list (many 16-entry splits), against the
    reference, and against one fixed split size within the rounding of bf16 outputs."""
    q, kv, idx, sink, scale = _inputs(3, 1, 64, 64, 200, 24, 300)
    got = backend.ops[OP](q, kv, idx, sink, scale)
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale), atol=1.6e-2, rtol=1.6e-2)
    fixed = backend.ops[OP](q, kv, idx, sink, scale, tiles=AttentionTiles(split_rows_max=10**9))
    torch.testing.assert_close(got, fixed, atol=8e-3, rtol=8e-3)


def test_int64_indices_and_empty_list():
    q, kv, idx, sink, scale = _inputs(2, 3, 16, 64, 8, 24, 90, dtype=torch.float32)
    got = backend.ops[OP](q, kv, idx.long(), sink, scale)
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale))
    empty = idx[:, :0]
    assert torch.equal(backend.ops[OP](q, kv, empty, sink, scale), torch.zeros_like(q))


@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)], ids=str
)
def test_mixed_dtypes_compute_like_the_reference(q_dtype, kv_dtype):
    q, kv, idx, sink, scale = _inputs(6, 3, 16, 64, 8, 24, 90, dtype=q_dtype, kv_dtype=kv_dtype)
    got = backend.ops[OP](q, kv, idx, sink, scale)
    assert got.dtype == q_dtype
    atol = 1e-5 if q_dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale), atol=atol, rtol=atol)


def test_rejects_bad_shapes():
    q, kv, idx, sink, scale = _inputs(3, 2, 16, 64, 4, 8, 40)
    with pytest.raises(ValueError, match="kv: expected"):
        backend.ops[OP](q, kv[:, :32], idx, sink, scale)
    with pytest.raises(ValueError, match="sink: expected shape"):
        backend.ops[OP](q, kv, idx, sink[:8], scale)
    with pytest.raises(ValueError, match="indices: expected"):
        backend.ops[OP](q, kv, idx[:1], sink, scale)
    with pytest.raises(ValueError, match=r"kv\[2\]: expected \[M, 64\]"):
        backend.ops[OP](q, (kv, kv, kv[:, :32]), idx, sink, scale)
    with pytest.raises(ValueError, match="1..3"):
        backend.ops[OP](q, (kv,) * 4, idx, sink, scale)


def test_batch_invariance(monkeypatch):
    """With DEEPINFER_BATCH_INVARIANT=1, row 0's output is bitwise identical for batches of 1,
    7 and 64 rows (64 is past the rows where the split path runs by default), from one KV
    tensor and from three sources."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    if HAS_CUDA:
        heads, dim, window, entries, num_kv = 64, 512, 128, 512, 131072 + 128
    else:
        heads, dim, window, entries, num_kv = 16, 32, 8, 24, 200
    sizes = (1, 7, 64)
    q, kv, idx, sink, scale = _inputs(4, max(sizes), heads, dim, window, entries, num_kv)
    sources = split_sources(kv, (torch.float8_e4m3fn, None, None))
    for kv_in in (kv, sources) if HAS_CUDA else (sources,):  # the interpreter is slow
        outs = [backend.ops[OP](q[:n], kv_in, idx[:n], sink, scale)[:1] for n in sizes]
        for other in outs[1:]:
            assert torch.equal(other, outs[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for([OP], "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[OP], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_sources", [1, 3])
def test_decode_at_model_shape_with_speed(kv_dtype, num_sources):
    q, kv, idx, sink, scale = _inputs(5, 128, 64, 512, 128, 512, 131072 + 128, kv_dtype=kv_dtype)
    kv = kv if num_sources == 1 else split_sources(kv)
    got = backend.ops[OP](q, kv, idx, sink, scale)
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale), atol=1.6e-2, rtol=1.6e-2)
    for name, fn in (("triton", backend.ops[OP]), ("reference", reference)):
        fn(q, kv, idx, sink, scale)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn(q, kv, idx, sink, scale)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / 10 * 1e6
        print(f"{name} {kv_dtype} {num_sources} sources: {elapsed:.1f} us")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "tiles",
    [AttentionTiles(block_n=32, num_stages=3, split_rows_max=0, halves=True),
     AttentionTiles(block_n=64, num_stages=2, split_rows_max=0, halves=True)],
    ids=["halves32", "halves64"],
)  # fmt: skip
def test_prefill_halves_at_model_shape(kv_dtype, tiles):
    """Prefill rows at the model shape (holes, duplicates, window-only rows from the shared
    index-list maker) through the two-halves whole-list kernel, from one tensor and (bitwise
    the same) from three sources."""
    q, kv, idx, sink, scale = _inputs(9, 300, 64, 512, 128, 512, 131072 + 128, kv_dtype=kv_dtype)
    got = backend.ops[OP](q, kv, idx, sink, scale, tiles=tiles)
    torch.testing.assert_close(got, reference(q, kv, idx, sink, scale), atol=1.6e-2, rtol=1.6e-2)
    assert torch.equal(backend.ops[OP](q, split_sources(kv), idx, sink, scale, tiles=tiles), got)
