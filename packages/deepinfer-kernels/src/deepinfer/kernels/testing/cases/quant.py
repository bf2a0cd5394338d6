"""Cases for the quant family: FP8 block / FP4 weights, activation quantisation, simulations.

Every op here is exact arithmetic on fp32 (powers of two, round-to-nearest-even casts), so the
cases demand bit equality (atol = rtol = 0). Inputs mix magnitudes across rows and plant exact
rounding ties (values half-way between two representable neighbours) so tie handling is tested.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.testing import Case, register

E2M1_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _float_rows(gen, shape, block, *, qmax, ties):
    """fp32 ``shape`` with per-row magnitudes 1e-3..1e3; each block's first element is
    ``qmax * 2^k`` (so its scale is exactly ``2^k``) and, if ``ties``, some elements sit on
    exact rounding ties of that scale."""
    rows = shape[0] if len(shape) > 1 else 1
    magnitude = torch.exp(torch.empty(rows, 1).uniform_(-7, 7, generator=gen))
    x = torch.randn(shape, generator=gen).reshape(rows, -1) * magnitude
    groups = x.view(rows, -1, block)
    exponent = torch.randint(-20, 20, groups.shape[:2], generator=gen).float()
    groups[:, :, 0] = qmax * torch.exp2(exponent) * torch.sign(groups[:, :, 0] + 1e-30)
    groups[:, :, 1:] = groups[:, :, 1:].clamp(-1.0, 1.0) * (qmax * torch.exp2(exponent))[..., None]
    if ties:
        pick = torch.randint(0, len(E2M1_TIES), groups[:, :, 1:4].shape, generator=gen)
        sign = torch.randint(0, 2, pick.shape, generator=gen) * 2 - 1
        groups[:, :, 1:4] = E2M1_TIES[pick] * sign * torch.exp2(exponent)[..., None]
    return x.reshape(shape)


def _fp8_dequant_inputs(gen, device, *, out, inp, block, out_dtype):
    # clamped to e4m3's range: beyond +-448 the cast gives NaN, whose bits differ between devices
    weight = (torch.randn(out, inp, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-out // block[0]), -(-inp // block[1]))
    scale = torch.randint(100, 140, grid, generator=gen, dtype=torch.uint8)
    args = (weight.to(device), scale.view(torch.float8_e8m0fnu).to(device), block)
    return args, {"out_dtype": out_dtype}


def _fp8_quant_inputs(gen, device, *, out, inp, block):
    weight = torch.randn(out, inp, generator=gen) * torch.exp(
        torch.empty(out, 1).uniform_(-5, 5, generator=gen)
    )
    return (weight.to(device), block), {}


def _fp4_dequant_inputs(gen, device, *, shape, block, out_dtype):
    *lead, k = shape
    packed = torch.randint(-128, 128, (*lead, k // 2), generator=gen, dtype=torch.int8)
    scale = torch.randint(100, 140, (*lead, k // block), generator=gen, dtype=torch.uint8)
    args = (packed.to(device), scale.view(torch.float8_e8m0fnu).to(device), block)
    return args, {"out_dtype": out_dtype}


def _fp4_quant_inputs(gen, device, *, shape, block, dtype):
    x = _float_rows(gen, shape, block, qmax=6.0, ties=True)
    return (x.to(dtype).to(device), block), {}


def _act_inputs(gen, device, *, shape, group, dtype, qmax, ties, kwargs=()):
    x = _float_rows(gen, shape, group, qmax=qmax, ties=ties)
    return (x.to(dtype).to(device), group), dict(kwargs)


def _case(op, name, scale, make_inputs, out_names=()):
    return Case(op, name, scale, make_inputs, out_names=out_names, atol=0.0, rtol=0.0)


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _weight_cases(scale, fp8_shapes, fp4_shapes):
    cases = []
    for out, inp, block in fp8_shapes:
        tag = f"{out}x{inp}-b{block[0]}x{block[1]}"
        for out_dtype in (torch.bfloat16, torch.float32):
            make = functools.partial(
                _fp8_dequant_inputs, out=out, inp=inp, block=block, out_dtype=out_dtype
            )
            cases.append(_case("fp8_block_dequant", f"{tag}-{_dtype_name(out_dtype)}", scale, make))
        make = functools.partial(_fp8_quant_inputs, out=out, inp=inp, block=block)
        cases.append(_case("fp8_block_quant", tag, scale, make))
    for shape in fp4_shapes:
        tag = "x".join(map(str, shape))
        make = functools.partial(
            _fp4_dequant_inputs, shape=shape, block=32, out_dtype=torch.bfloat16
        )
        cases.append(_case("fp4_dequant", tag, scale, make))
        make = functools.partial(_fp4_quant_inputs, shape=shape, block=32, dtype=torch.float32)
        cases.append(_case("fp4_quant", tag, scale, make))
    return cases


def _activation_cases(scale, shapes):
    cases = []
    for shape in shapes:
        tag = "x".join(map(str, shape))
        for dtype in (torch.bfloat16, torch.float32):
            name = f"{tag}-{_dtype_name(dtype)}"
            for group in (128, 64, 32):
                common = dict(shape=shape, group=group, dtype=dtype, qmax=448.0, ties=False)
                make = functools.partial(_act_inputs, **common)
                cases.append(_case("fp8_act_quant", f"{name}-g{group}", scale, make))
                cases.append(_case("fp8_sim", f"{name}-g{group}", scale, make, ("out",)))
            for group, fmt in ((32, "ue8m0"), (16, "e4m3")):
                common = dict(shape=shape, group=group, dtype=dtype, qmax=6.0, ties=True)
                make = functools.partial(_act_inputs, **common, kwargs={"scale_fmt": fmt})
                cases.append(_case("fp4_sim", f"{name}-g{group}-{fmt}", scale, make, ("out",)))
    return cases


register(
    *_weight_cases(
        "small",
        [(64, 96, (32, 32)), (200, 256, (128, 128)), (7, 64, (1, 32))],
        [(16, 64), (3, 8, 128)],
    ),
    *_activation_cases("small", [(5, 128), (2, 3, 256)]),
    *_weight_cases(
        "real",
        [(32768, 1024, (128, 128)), (4096, 8192, (128, 128)), (1280, 5120, (32, 32))],
        [(2048, 4096), (8, 2304, 5120)],
    ),
    *_activation_cases("real", [(4096, 4096), (1, 5120), (16384, 512)]),
)
