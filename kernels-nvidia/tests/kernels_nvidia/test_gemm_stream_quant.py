"""The stream GEMM (decode) quantising its own activation rows: bit for bit the output of
quantising first, on CPU under the interpreter and on the GPU at model shapes, and ``linear`` /
``linears`` taking it for decode plans."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.testing.cases.gemm import random_fp8_weight
from deepinfer.kernels_nvidia.gemm import ops as gemm
from deepinfer.kernels_nvidia.gemm import stream as gemm_stream
from deepinfer.kernels_nvidia.quant import quantize_rows

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
@pytest.mark.parametrize("m", [1, 6, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_stream_kernel_quantising_its_rows_equals_quantising_first(m, block, dtype):
    """In-kernel activation quantisation (``a_scale=None``): the output bit for bit that of
    ``quantize_rows`` then the same kernel, at split-K 1 and 4, ragged N, rows spanning four
    orders of magnitude (different scales per group)."""
    gen = torch.Generator().manual_seed(m * 7 + block[0])
    n, k = 200, 512
    w, s = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k // block[1]).repeat_interleave(
        block[1]
    )
    x = x.to(DEVICE, dtype)
    for target in (1, 4 * -(-n // 64)):
        tiles = gemm.StreamTiles(block_n=64, target_programs=target)
        xq, xs = quantize_rows(x, block[1])
        want = gemm_stream.fp8_gemm_stream(
            xq, xs, w, s.view(torch.uint8), block, block[1], block[1], torch.float32, tiles
        )
        got = gemm_stream.fp8_gemm_stream(
            x, None, w, s.view(torch.uint8), block, block[1], block[1], torch.float32, tiles
        )
        assert torch.equal(got, want), (target, (got - want).abs().max())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 32, 64])
@pytest.mark.parametrize(
    "n, k, block",
    [(1536, 4096, (128, 128)), (4096, 1024, (128, 128)), (2048, 4096, (32, 32))],
    ids=str,
)
def test_stream_kernel_quantising_its_rows_at_model_shapes(n, k, block, m):
    """The same bit-for-bit equality on the GPU at V4 / V4.1 decode shapes (the kernel's own
    split-K), through ``linear`` (whose decode plan is this kernel) against quantising first."""
    gen = torch.Generator().manual_seed(n + k + m)
    w, s = random_fp8_weight(gen, n, k, block, torch.device(DEVICE))
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    plan = gemm.default_plan(m, n, k, block[1], block[1], block, torch.bfloat16, x.device)
    if plan.kind != "stream":
        pytest.skip(f"M={m} takes the {plan.kind} plan here")
    assert gemm._quantises_in_kernel(plan, m, block[1], block[1]) == (m <= 16)
    want = gemm.fp8_gemm_nt_plan(*quantize_rows(x, block[1]), w, s, block,
                                 out_dtype=torch.bfloat16, plan=plan)  # fmt: skip
    fused = gemm_stream.fp8_gemm_stream(x, None, w, s.view(torch.uint8), block, block[1],
                                        block[1], torch.bfloat16, plan.tiles)  # fmt: skip
    assert torch.equal(fused, want)  # the kernel itself: a compile failure fails here
    assert torch.equal(gemm.linear(x, w, s, block_size=block, act_quant_group=block[1]), want)
    assert gemm._QUANTISING_STREAM["ok"]


def test_linear_takes_the_quantising_stream_kernel_for_decode_plans(monkeypatch):
    """Where the plan is the stream kernel, ``linear`` and ``linears`` launch no separate
    activation quantiser, and their outputs equal quantising first (on CPU the plan is
    forced: the interpreter's own plan is the tiles)."""
    block = (128, 128)
    gen = torch.Generator().manual_seed(11)
    device = torch.device(DEVICE)
    (w1, s1), (w2, s2) = (random_fp8_weight(gen, n, 256, block, device) for n in (96, 64))
    x = torch.randn(2, 3, 256, generator=gen).to(DEVICE, torch.bfloat16)
    kw = {"block_size": block, "act_quant_group": 128}
    tiles = gemm.StreamTiles(block_n=64, target_programs=4)
    stream = gemm.GemmPlan("stream", tiles)
    assert gemm._quantises_in_kernel(stream, 16, 128, 128)
    assert not gemm._quantises_in_kernel(stream, 17, 128, 128)  # past the bound
    want = [
        gemm.fp8_gemm_nt_tiles(*quantize_rows(x.view(6, 256), 128), w, s, block,
                               out_dtype=torch.bfloat16, tiles=tiles).view(2, 3, -1)
        for w, s in ((w1, s1), (w2, s2))
    ]  # fmt: skip
    monkeypatch.setattr(gemm, "default_plan", lambda *a, **k: gemm.GemmPlan("stream", tiles))

    def no_quantiser(*args, **kwargs):
        raise AssertionError("a separate activation quantisation ran")

    monkeypatch.setattr(gemm, "quantize_rows", no_quantiser)
    assert torch.equal(gemm.linear(x, w1, s1, **kw), want[0])
    got = gemm.linears(x, (w1, w2), (s1, s2), **kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_kernel_the_gpu_will_not_compile_falls_back_to_quantising_first(monkeypatch, caplog):
    """If the GPU's compiler refuses the quantising kernel, ``linear`` warns once and runs
    the two-launch path for the rest of the process, with the same output."""
    block = (128, 128)
    gen = torch.Generator().manual_seed(12)
    w, s = random_fp8_weight(gen, 64, 256, block, torch.device(DEVICE))
    x = torch.randn(3, 256, generator=gen).to(DEVICE, torch.bfloat16)
    tiles = gemm.StreamTiles(block_n=64, target_programs=4)
    monkeypatch.setattr(gemm, "default_plan", lambda *a, **k: gemm.GemmPlan("stream", tiles))
    want = gemm.linear(x, w, s, block_size=block, act_quant_group=128)
    calls, real = [], gemm.fp8_gemm_stream

    def refused(a, a_scale, *args, **kwargs):  # the quantising variant only
        if a_scale is not None:
            return real(a, a_scale, *args, **kwargs)
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(gemm, "fp8_gemm_stream", refused)
    monkeypatch.setattr(gemm, "_on_gpu", lambda t: True)
    monkeypatch.setitem(gemm._QUANTISING_STREAM, "ok", True)
    with caplog.at_level("WARNING"):
        got = gemm.linear(x, w, s, block_size=block, act_quant_group=128)
        again = gemm.linear(x, w, s, block_size=block, act_quant_group=128)
    assert len(calls) == 1 and not gemm._QUANTISING_STREAM["ok"]
    assert "did not compile" in caplog.text
    assert torch.equal(got, want) and torch.equal(again, want)
