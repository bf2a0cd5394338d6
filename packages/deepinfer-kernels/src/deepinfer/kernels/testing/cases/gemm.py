"""Cases for fp8_gemm_nt and the FP8-weight path of linear and linears (activation quantised to
FP8).

Tolerances: every product of scaled e4m3 values is exact in fp32, so the reference and a kernel
differ by fp32 summation order (Hopper's FP8 tensor cores also add with a shorter mantissa inside
each K block) and the final rounding: one bf16 rounding for bf16 outputs. ``linear`` cases quantise
the activation inside the op; the Triton interpreter rounds some fp32 -> e4m3 casts wrongly
(spec toolchain.md), which moves outputs by a few percent of their spread, hence the wider atol.
Inputs are scaled so outputs have unit spread.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.reference import quant
from deepinfer.kernels.testing import Case, register


def _device_generator(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen`` (real shapes are drawn on the device)."""
    seeded = torch.Generator(device=device)
    seeded.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    return seeded


def random_fp8_weight(gen, n, k, block, device):
    """``(q [n, k] e4m3, scale e8m0)`` whose dequantised entries have spread ~ ``1/sqrt(k)``."""
    g = _device_generator(gen, device)
    q = (torch.randn(n, k, generator=g, device=device) * 64).to(torch.float8_e4m3fn)
    grid = (-(-n // block[0]), -(-k // block[1]))
    centre = 127 - 6 - round(0.5 * torch.log2(torch.tensor(float(k))).item())
    exps = torch.randint(centre - 1, centre + 2, grid, generator=g, device=device)
    return q, exps.to(torch.uint8).view(torch.float8_e8m0fnu)


def _gemm_inputs(gen, device, *, m, n, k, block, out_dtype):
    g = _device_generator(gen, device)
    x = torch.randn(m, k, generator=g, device=device) * torch.exp(
        torch.empty(m, 1, device=device).uniform_(-2, 2, generator=g)
    )
    a, a_scale = quant.fp8_act_quant(x / x.abs().amax(-1, keepdim=True), block[1])
    b, b_scale = random_fp8_weight(gen, n, k, block, device)
    return (a, a_scale, b, b_scale, block), {"out_dtype": out_dtype}


def _linear_inputs(gen, device, *, m, n, k, block, dtype):
    g = _device_generator(gen, device)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    weight, scale = random_fp8_weight(gen, n, k, block, device)
    return (x, weight, scale), {"block_size": block, "act_quant_group": block[1]}


def _linears_inputs(gen, device, *, m, n, k, block, dtype):
    """One input, two FP8 weights of different widths (the second ``n / 2`` rounded up to a
    scale block)."""
    (x, w1, s1), kw = _linear_inputs(gen, device, m=m, n=n, k=k, block=block, dtype=dtype)
    w2, s2 = random_fp8_weight(gen, max(block[0], n // 2), k, block, device)
    return (x, (w1, w2), (s1, s2)), kw


def _padded_rows(args):
    a = args[0]
    wide = torch.zeros(a.shape[0], a.shape[1] + 64, dtype=a.dtype, device=a.device)
    wide[:, : a.shape[1]] = a
    return (wide[:, : a.shape[1]], *args[1:])


def _cases(scale, shapes):
    cases = []
    for m, n, k, block in shapes:
        tag = f"{m}x{n}x{k}-b{block[0]}"
        for out_dtype, atol, rtol in ((torch.bfloat16, 2e-2, 1.6e-2), (torch.float32, 2e-3, 2e-3)):
            make = functools.partial(_gemm_inputs, m=m, n=n, k=k, block=block, out_dtype=out_dtype)
            name = f"{tag}-{str(out_dtype).removeprefix('torch.')}"
            strided = _padded_rows if m > 1 else None
            cases.append(
                Case("fp8_gemm_nt", name, scale, make, make_strided=strided, atol=atol, rtol=rtol)
            )
        make = functools.partial(_linear_inputs, m=m, n=n, k=k, block=block, dtype=torch.bfloat16)
        cases.append(Case("linear", f"fp8-{tag}", scale, make, atol=6e-2, rtol=2e-2))
        if scale == "small" or m <= 64:  # (real: decode-sized, where sharing pays)
            make = functools.partial(_linears_inputs, m=m, n=n, k=k, block=block,
                                     dtype=torch.bfloat16)  # fmt: skip
            cases.append(Case("linears", f"fp8-{tag}", scale, make, atol=6e-2, rtol=2e-2))
    return cases


V4_FLASH_LINEARS = [
    (1024, 4096),
    (32768, 1024),
    (512, 4096),
    (4096, 8192),
    (2048, 4096),
    (4096, 2048),
]
V41_FLASH_LINEARS = [(1280, 5120), (32768, 1280), (2304, 5120), (5120, 2304)]

register(
    *_cases(
        "small",
        [(33, 96, 256, (128, 128)), (5, 64, 128, (32, 32)), (1, 160, 64, (32, 32))],
    ),
    *_cases(
        "real",
        [(m, n, k, (128, 128)) for m in (1, 64, 4096) for n, k in V4_FLASH_LINEARS[:3]]
        + [(m, n, k, (32, 32)) for m in (7, 2048) for n, k in V41_FLASH_LINEARS]
        + [(1000, n, k, (128, 128)) for n, k in V4_FLASH_LINEARS[3:]],
    ),
)
