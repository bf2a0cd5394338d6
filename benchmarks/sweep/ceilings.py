"""Measured device ceilings for the roofline: copy bandwidth and matmul (tensor-core) rate.

On CUDA: device events after warm-up (``benchmarks/common.py``), bf16 GEMMs at 8192^3. On CPU
(smoke mode) the same quantities by wall clock at small sizes, so the CPU plot shows the CPU's
own ceiling.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import copy_bandwidth_tbs, time_cuda
from roofline import Device


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


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device copy, counting bytes read plus bytes written."""
    if device == "cuda":
        return copy_bandwidth_tbs() * 1e12
    num_bytes = 64 * 2**20
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _cpu_seconds(lambda: dst.copy_(src))


def measure_device(device: str) -> Device:
    size = 8192 if device == "cuda" else 512
    return Device(bandwidth=copy_bandwidth(device), flops=matmul_flops(device, size))
