"""Measured device ceilings for the roofline: copy bandwidth and matmul (tensor-core) rate.

On CUDA: device events after warm-up (``benchmarks/common.py``), bf16 GEMMs at 8192^3. On CPU
(smoke mode) the same quantities by wall clock at small sizes, so the CPU plot shows the CPU's
own ceiling.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import copy_bandwidth_tbs, time_cuda
from benchmarks.sweep.roofline import Device


def _cpu_seconds(fn, iters: int = 5) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(device: str, size: int) -> float:
    """FLOP/s of a ``size``^3 bf16 GEMM (the tensor-core rate on a GPU)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    if device == "cuda":
        seconds = time_cuda(lambda: a @ b, warmup=5, iters=20) * 1e-3
    else:
        seconds = _cpu_seconds(lambda: a @ b)
    return 2 * size**3 / seconds


def fp8_matmul_flops(size: int = 8192) -> float:
    """FLOP/s of a ``size``^3 FP8 e4m3 GEMM with bf16 output (``torch._scaled_mm``), the rate
    the model's FP8 linear layers can reach on Hopper."""
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return 2 * size**3 / (time_cuda(gemm, warmup=5, iters=20) * 1e-3)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device copy, counting bytes read plus bytes written."""
    if device == "cuda":
        return copy_bandwidth_tbs() * 1e12
    num_bytes = 64 * 2**20
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _cpu_seconds(lambda: dst.copy_(src))


def measure_device(device: str) -> tuple[Device, dict[str, float]]:
    """The ceilings and what was measured: for the linear layers, on CUDA the FP8 GEMM rate when
    this torch/GPU has one (they are FP8), else the bf16 rate; for attention the bf16 rate."""
    measured = {"copy_Bps": copy_bandwidth(device)}
    measured["bf16_gemm_flops"] = matmul_flops(device, 8192 if device == "cuda" else 512)
    if device == "cuda":
        try:
            measured["fp8_gemm_flops"] = fp8_matmul_flops()
        except (RuntimeError, AttributeError) as e:  # no FP8 tensor cores or no _scaled_mm
            print(f"FP8 GEMM rate not measured ({e}); the roofline uses the bf16 rate")
    flops = max(measured["bf16_gemm_flops"], measured.get("fp8_gemm_flops", 0.0))
    ceiling = Device(measured["copy_Bps"], flops, attention_flops=measured["bf16_gemm_flops"])
    return ceiling, measured
