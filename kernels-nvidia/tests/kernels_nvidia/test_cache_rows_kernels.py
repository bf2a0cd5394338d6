"""pack_rows / write_rows / unpack_rows Triton kernels: the reference's bytes (and values), bit
for bit, for every row format the models use, on random rows and on planted extremes (grid
maxima and beyond, rounding ties, signed zeros, subnormals, all-zero rows, fp32's largest
values). fp32 inputs run on the interpreter; bf16 inputs and model sizes on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.kernels import OPS, RowFormat
from deepinfer.kernels.testing import cases_for, check_case
from deepinfer.kernels.testing.cases.cache_rows import FORMATS, random_rows
from deepinfer.kernels_nvidia import backend, cache_rows

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: the Triton interpreter (see conftest)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
reference = OPS["pack_rows"].reference
OPS_HERE = ["pack_rows", "write_rows", "unpack_rows"]

# e2m1 midpoints and e4m3 midpoints (normal and subnormal) at scale 1, and their negatives
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 5.9, 0.2500001]
E4M3_TIES = [448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-6 - 2.0**-11, 432.0, 1.5]


def pack(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    return backend.ops["pack_rows"](x, fmt)


def _block_of(values: list[float], block: int) -> torch.Tensor:
    """``values`` and their negatives cycled to fill one block."""
    signed = torch.tensor(values + [-v for v in values], dtype=torch.float32)
    return signed.repeat(-(-block // signed.numel()))[:block]


def edge_rows(fmt: RowFormat, gen: torch.Generator) -> torch.Tensor:
    """Rows of planted extremes, one kind of block per row (the tail random)."""
    tiny = 2.0**-149
    kinds = [
        torch.zeros(fmt.block),
        torch.full((fmt.block,), -0.0),
        _block_of([tiny, 3 * tiny, 2.0**-127, 2.0**-130, 0.7 * 2.0**-126], fmt.block),
        _block_of([2.0**-127, -0.0, 2.0**-126 * 6, 0.0], fmt.block),
        _block_of([3.0e38, 1.0e38, 1.0, 0.0], fmt.block),
        _block_of([2688.0, 3000.0, 1.0e4, 0.1], fmt.block),  # e4m3 scale saturates at 448
        _block_of(E2M1_TIES if fmt.code == "e2m1" else E4M3_TIES, fmt.block),
        _block_of([v * 2.0**-20 for v in E2M1_TIES + E4M3_TIES], fmt.block),
        _block_of([1.0e-4 * 448 * 0.999, 6.0 * 2.0**-9 * 1.01, 2.0**-9 * 6], fmt.block),
        # an e4m3 scale rounded down (amax / 6 at or above a midpoint): codes clamp at 6
        _block_of([6.0 * 1.0625, 6.0 * 1.1875, 6.0 * 1.06], fmt.block),
    ]
    nb = fmt.quantised // fmt.block
    rows = []
    for kind in kinds:
        for shift in (0, 1):  # the planted block alone, and between random blocks
            row = torch.randn(fmt.dim, generator=gen) * 10.0
            blocks = row[: fmt.quantised].view(nb, fmt.block)
            if shift == 0:
                blocks.copy_(kind)
            else:
                blocks[nb // 2].copy_(kind)
            rows.append(row)
    return torch.stack(rows)


def _with_tail(fmt: RowFormat, tail_dtype: torch.dtype) -> RowFormat:
    return RowFormat(fmt.dim, fmt.quantised, fmt.code, fmt.block, fmt.scale, tail_dtype)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_planted_extremes_match_the_reference(name):
    fmt = FORMATS[name]
    x = edge_rows(fmt, torch.Generator().manual_seed(7)).to(DEVICE)
    got, want = pack(x, fmt), reference(x, fmt)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{name}: rows {bad} differ from the reference"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_rows_match_the_reference(name):
    """Wide magnitudes (1e-6..1e3 per row), a fp32 tail, leading dims and strided rows."""
    gen = torch.Generator().manual_seed(11)
    fmt = _with_tail(FORMATS[name], torch.float32)
    x = random_rows(gen, 6, 2 * fmt.dim).to(DEVICE)[:, : fmt.dim].unflatten(0, (2, 3))
    assert not x.is_contiguous()
    got = pack(x, fmt)
    assert got.shape == (2, 3, fmt.row_bytes)
    assert torch.equal(got, reference(x, fmt))


def test_several_rows_per_program_match_the_reference(monkeypatch):
    """One program packing several rows (as at prefill sizes), the last program partly."""
    monkeypatch.setattr(cache_rows, "_MIN_PROGRAMS", 1)
    fmt = FORMATS["index"]
    x = random_rows(torch.Generator().manual_seed(12), 40, fmt.dim).to(DEVICE)
    assert torch.equal(pack(x, fmt), reference(x, fmt))


@pytest.mark.parametrize("name", ["v4kv", "v41entry"])
def test_write_rows_scatters_what_index_copy_of_the_reference_stores(name):
    """The fused pack and scatter: the destination rows get the reference's bytes, the rest of
    the cache keeps its (random) bytes."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(19)
    cache = torch.randint(0, 256, (24, fmt.row_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.randperm(24, generator=gen)[:9]
    x = torch.cat([edge_rows(fmt, gen)[:5], random_rows(gen, 4, fmt.dim)])
    want = cache.clone().index_copy_(0, dst, reference(x, fmt)).to(DEVICE)
    cache, dst, x = cache.to(DEVICE), dst.to(DEVICE, torch.int32), x.to(DEVICE)
    got = backend.ops["write_rows"](cache, dst, x, fmt)
    assert got is cache and torch.equal(cache, want)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_unpack_rows_of_planted_extremes_match_the_reference_bit_for_bit(name, out_dtype):
    """The packed bytes of the extremes (subnormal codes, saturated scales, signed zeros), a
    fp32 tail, leading dims and rows taken with a stride: the reference's values' bits."""
    fmt = _with_tail(FORMATS[name], torch.float32)
    gen = torch.Generator().manual_seed(23)
    x = torch.cat([edge_rows(fmt, gen), random_rows(gen, 10, fmt.dim)])  # 30 rows
    packed = reference(x, fmt)
    wide = torch.cat([packed, packed], dim=1)[:, : fmt.row_bytes].unflatten(0, (-1, 3))
    assert not wide.is_contiguous()
    want = OPS["unpack_rows"].reference(wide, fmt, out_dtype)
    got = backend.ops["unpack_rows"](wide.to(DEVICE), fmt, out_dtype)
    assert got.dtype == out_dtype and got.shape == want.shape
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    assert torch.equal(got.cpu().view(bits), want.view(bits))


def test_unpack_rows_names_bad_rows():
    fmt = FORMATS["index"]
    with pytest.raises(ValueError, match=r"rows: expected uint8 \[..., 80\]"):
        backend.ops["unpack_rows"](torch.zeros(2, 64, dtype=torch.uint8, device=DEVICE), fmt)
    assert backend.ops["unpack_rows"](torch.zeros(0, 80, dtype=torch.uint8), fmt).shape == (0, 128)


def test_write_rows_names_bad_arguments():
    fmt = FORMATS["index"]
    cache = torch.zeros(8, fmt.row_bytes, dtype=torch.uint8, device=DEVICE)
    x, dst = torch.randn(2, fmt.dim, device=DEVICE), torch.tensor([1, 3], device=DEVICE)
    with pytest.raises(ValueError, match=r"cache: expected uint8 \[N, 80\]"):
        backend.ops["write_rows"](cache[:, :64], dst, x, fmt)
    with pytest.raises(ValueError, match=r"values: expected \[n, 128\]"):
        backend.ops["write_rows"](cache, dst, x[:, :64], fmt)
    with pytest.raises(ValueError, match=r"dst: expected int32/int64 \[2\]"):
        backend.ops["write_rows"](cache, dst.float(), x, fmt)


def test_formats_the_kernel_leaves_to_the_reference():
    x = random_rows(torch.Generator().manual_seed(13), 3, 96).to(DEVICE)
    for fmt in (
        RowFormat(96, 96, "e4m3", 48, "ue8m0"),  # a block that is not a power of two
        RowFormat(96, 64, "e4m3", 32, "e4m3"),  # FP8 codes with e4m3 scales
    ):
        assert torch.equal(pack(x, fmt), reference(x, fmt))
    fmt = RowFormat(96, 64, "e2m1", 32, "ue8m0")
    assert torch.equal(pack(x.double(), fmt), reference(x.double(), fmt))
    assert pack(x[:0], fmt).shape == (0, fmt.row_bytes)


def test_rows_of_the_wrong_width_are_named():
    with pytest.raises(ValueError, match=r"x: expected \[..., 512\]"):
        pack(torch.zeros(2, 64, device=DEVICE), FORMATS["v4kv"])


@pytest.mark.parametrize(
    "case",
    [c for c in cases_for(OPS_HERE, "small") if HAS_CUDA or c.name.endswith("float32")],
    ids=str,
)
def test_conformance_small(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", cases_for(OPS_HERE, "real"), ids=str)
def test_conformance_real(case):
    check_case(backend.ops[case.op], case, DEVICE)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_bf16_planted_extremes_and_speed(name):
    """bf16 rows (the model's dtype) at prefill size; prints the kernel's time against the
    reference's."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(17)
    edges = edge_rows(fmt, gen).to(torch.bfloat16)
    x = torch.cat([edges, random_rows(gen, 8192, fmt.dim, torch.bfloat16)]).to(DEVICE)
    assert torch.equal(pack(x, fmt), reference(x, fmt))
    times = {}
    for label, fn in (("triton", pack), ("reference", reference)):
        fn(x, fmt)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn(x, fmt)
        torch.cuda.synchronize()
        times[label] = (time.perf_counter() - start) / 20 * 1e6
    print(f"pack_rows {name} {x.shape[0]} rows: {times['triton']:.1f} us (reference "
          f"{times['reference']:.1f} us)")  # fmt: skip
