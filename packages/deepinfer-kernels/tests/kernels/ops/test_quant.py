"""The quant op family: hand-computed cases, round trips, and the conformance cases."""

from __future__ import annotations

import pytest
import torch

import deepinfer.kernels as K
from deepinfer.kernels.registry import OPS
from deepinfer.kernels.testing import cases_for, check_case

QUANT_OPS = [
    "fp8_block_dequant",
    "fp8_block_quant",
    "fp4_dequant",
    "fp4_quant",
    "fp8_act_quant",
    "fp8_sim",
    "fp4_sim",
]
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e8m0(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_ops_are_registered_and_exported():
    for name in QUANT_OPS:
        assert name in OPS
        assert getattr(K, name).op_name == name


# --- hand-computed dequantisation -------------------------------------------------------------


def test_e8m0_bias_is_127():
    weight = torch.ones(1, 3, dtype=torch.float8_e4m3fn)
    for byte, expected in [(127, 1.0), (130, 8.0), (120, 2.0**-7), (0, 2.0**-127)]:
        scale = e8m0(byte).view(1, 1)
        got = K.fp8_block_dequant(weight, scale, (1, 32), out_dtype=torch.float32)
        assert got.tolist() == [[expected] * 3]


def test_fp4_nibble_order_low_is_even_column():
    # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) is column 1.
    # byte 0xF8: low nibble 8 is -0.0, high nibble 15 is -6.
    packed = torch.tensor([[0x21, 0xF8 - 256] + [0] * 14], dtype=torch.int8)
    got = K.fp4_dequant(packed, e8m0(128).view(1, 1), 32, out_dtype=torch.float32)
    assert got[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert torch.signbit(got[0, 2])
    assert not torch.signbit(got[0, 4])


def test_fp4_every_code_decodes_to_the_e2m1_table():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(torch.int8).repeat(1, 4)  # 64 columns
    got = K.fp4_dequant(packed, e8m0(127, 127), 32, out_dtype=torch.float32)[0, :16]
    expected = E2M1_GRID + [-v for v in E2M1_GRID]
    assert got.tolist() == expected
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_fp4_scale_granularity_is_32_columns():
    packed = torch.full((2, 64), 0x22, dtype=torch.int8)  # every value 1.0, 128 columns
    scale = torch.tensor([[127, 128, 129, 130], [126, 127, 127, 127]], dtype=torch.uint8)
    got = K.fp4_dequant(packed, scale.view(torch.float8_e8m0fnu), 32, out_dtype=torch.float32)
    expected = torch.tensor([[1.0, 2.0, 4.0, 8.0], [0.5, 1.0, 1.0, 1.0]]).repeat_interleave(32, 1)
    assert torch.equal(got, expected)


def test_fp8_block_granularity_with_partial_edge_blocks():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(130, 200, generator=gen) * 10).to(torch.float8_e4m3fn)
    scale_bytes = torch.tensor([[120, 130], [125, 127]], dtype=torch.uint8)
    got = K.fp8_block_dequant(
        weight, scale_bytes.view(torch.float8_e8m0fnu), (128, 128), out_dtype=torch.float32
    )
    w = weight.float()
    assert torch.equal(got[:128, :128], w[:128, :128] * 2.0**-7)
    assert torch.equal(got[:128, 128:], w[:128, 128:] * 2.0**3)
    assert torch.equal(got[128:, :128], w[128:, :128] * 2.0**-2)
    assert torch.equal(got[128:, 128:], w[128:, 128:])


def test_fp8_dequant_matches_torch_native_e8m0_conversion():
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(64, 96, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(90, 160, (2, 3), generator=gen, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    got = K.fp8_block_dequant(weight, scale, (32, 32), out_dtype=torch.float32)
    native = scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(got, weight.float() * native)
    assert torch.equal(
        K.fp8_block_dequant(weight, scale, (32, 32)), (weight.float() * native).bfloat16()
    )


# --- hand-computed quantisation -----------------------------------------------------------


@pytest.mark.parametrize(
    "amax, exponent",
    [(448.0, 0), (449.0, 1), (224.0, -1), (224.5, 0), (1.0, -8), (0.0, -22), (3.0e-5, -22)],
)
def test_act_quant_scale_is_ceil_pow2_of_amax_over_448(amax, exponent):
    x = torch.zeros(2, 32)
    x[0, 5] = -amax
    x[1] = torch.linspace(-1, 1, 32) * amax
    q, s = K.fp8_act_quant(x, 32)
    assert s.tolist() == [[2.0**exponent], [2.0**exponent]]
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float() * s.repeat_interleave(32, -1), K.fp8_sim(x, 32))


def test_act_quant_groups_are_contiguous_along_last_dim():
    x = torch.ones(1, 128)
    x[0, 64:] = 100.0
    _, s = K.fp8_act_quant(x, 64)
    assert s.tolist() == [[2.0**-8, 2.0**-2]]  # 1/448 -> 2^-8, 100/448 -> 2^-2


def test_fp8_sim_rounds_to_nearest_even_and_keeps_dtype():
    # scale 1 (amax 448): 17 is a tie between 16 and 18 (step 2 in [16, 32)) -> 16 (even),
    # 19 is a tie between 18 and 20 -> 20; 0.0009765625 = 2^-10 is half the smallest
    # subnormal (2^-9) -> 0; -0.0 stays -0.0.
    x = torch.tensor([[448.0, 17.0, 19.0, 2.0**-10, -0.0, -3.3] + [0.0] * 26])
    got = K.fp8_sim(x.bfloat16(), 32)
    assert got.dtype == torch.bfloat16
    assert got[0, :5].float().tolist() == [448.0, 16.0, 20.0, 0.0, -0.0]
    assert torch.signbit(got[0, 4].float())
    assert got[0, 5].item() == -3.25


def test_fp8_sim_in_place_form():
    x = torch.randn(4, 64) * 3
    expected = K.fp8_sim(x, 64)
    K.fp8_sim(x, 64, out=x)
    assert torch.equal(x, expected)


def test_fp4_sim_ties_go_to_the_even_code():
    # amax 6 -> ue8m0 scale 1; ties between neighbouring e2m1 magnitudes.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor([[6.0, *ties, *[-t for t in ties]] + [0.0] * 17])
    got = K.fp4_sim(x, 32)[0]
    assert got[1:8].tolist() == expected
    assert got[8:15].tolist() == [-v for v in expected]


def test_fp4_sim_matches_brute_force_nearest():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=gen) * 3
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True) / 6)))
    grid = torch.tensor(E2M1_GRID)
    scaled = (x / scale).abs().clamp_max(6)
    nearest = grid[(scaled.unsqueeze(-1) - grid).abs().argmin(-1)]  # no ties in random data
    assert torch.equal(K.fp4_sim(x, 32), torch.copysign(nearest, x) * scale)


def test_fp4_sim_e4m3_scale_and_clamp():
    # amax 7: s = e4m3(7 / 6) = 1.125 (e4m3 step 0.125 in [1, 2)); 7 / 1.125 = 6.22 clamps to 6.
    x = torch.tensor([[7.0, 1.0, -2.0, 0.1] + [0.0] * 12])
    got = K.fp4_sim(x, 16, scale_fmt="e4m3")[0, :4]
    # 1 / 1.125 = 0.889 -> 1.0; 2 / 1.125 = 1.78 -> 2.0; 0.1 / 1.125 = 0.089 -> 0.
    assert got.tolist() == [6.75, 1.125, -2.25, 0.0]
    with pytest.raises(ValueError, match="scale_fmt"):
        K.fp4_sim(x, 16, scale_fmt="e5m2")


def test_fp4_quant_negative_zero_and_saturation():
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0
    x[0, 1] = -0.0
    x[0, 2] = -0.1  # rounds to -0: keeps the sign bit
    x[0, 3] = 5.9
    packed, scale = K.fp4_quant(x)
    raw = packed.view(torch.uint8)[0]
    assert scale.view(torch.uint8).tolist() == [[127]]
    assert int(raw[0]) == 0x87  # col0 6.0 (code 7) low, col1 -0.0 (code 8) high
    assert int(raw[1]) == 0x78  # col2 -0 (code 8) low, col3 6.0 (code 7) high


def test_bad_group_size_names_the_shape():
    with pytest.raises(ValueError, match=r"block/group size 48 .*\(2, 100\)"):
        K.fp8_act_quant(torch.randn(2, 100), 48)


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((96, 64), (32, 32))])
def test_fp8_block_round_trip_error_is_within_half_an_ulp(shape, block):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))
    q, s = K.fp8_block_quant(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    back = K.fp8_block_dequant(q, s, block, out_dtype=torch.float32)
    scale = s.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    scale = scale[: shape[0], : shape[1]]
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((back - w).abs() <= bound).all()
    assert (q.float().abs().amax() <= 448) and (q.float().abs().amax() > 224)
    # quantising an already-quantised weight reproduces it exactly
    q2, s2 = K.fp8_block_quant(back, block)
    assert torch.equal(K.fp8_block_dequant(q2, s2, block, out_dtype=torch.float32), back)


def test_fp4_round_trip_is_exact_on_grid_values():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (3, 8, 64), generator=gen)
    values = torch.tensor(E2M1_GRID + [-v for v in E2M1_GRID])[codes]
    values[..., ::32] = 6.0  # pin each block's amax so its scale is exactly 2^k
    exponents = torch.randint(-10, 10, (3, 8, 2), generator=gen).float()
    w = values * torch.exp2(exponents).repeat_interleave(32, -1)
    packed, scale = K.fp4_quant(w)
    assert packed.shape == (3, 8, 32) and scale.shape == (3, 8, 2)
    assert torch.equal(scale.float(), torch.exp2(exponents))
    assert torch.equal(K.fp4_dequant(packed, scale, out_dtype=torch.float32), w)


def test_fp4_round_trip_error_bound_on_random_weights():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 128, generator=gen)
    packed, scale = K.fp4_quant(w)
    back = K.fp4_dequant(packed, scale, out_dtype=torch.float32)
    assert torch.equal(back, K.fp4_sim(w, 32))
    step = scale.float().repeat_interleave(32, -1)  # e2m1 spacing is at most 2 * scale
    assert ((back - w).abs() <= step).all()


# --- conformance cases (reference against itself, proves the cases are well formed) -------


@pytest.mark.parametrize("case", cases_for(QUANT_OPS, "small"), ids=str)
def test_conformance_cases_run_on_reference(case):
    check_case(OPS[case.op].reference, case, device="cpu", seed=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", cases_for(QUANT_OPS, "real"), ids=str)
def test_reference_on_cuda_matches_cpu(case):
    """The reference twins give the same bits on the GPU as on the CPU at model sizes."""
    gen = torch.Generator().manual_seed(8)
    args, kwargs = case.make_inputs(gen, torch.device("cuda"))
    on_gpu = OPS[case.op].reference(*args, **kwargs)
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    on_cpu = OPS[case.op].reference(*cpu_args, **kwargs)
    for g, c in zip(
        on_gpu if isinstance(on_gpu, tuple) else (on_gpu,),
        on_cpu if isinstance(on_cpu, tuple) else (on_cpu,),
    ):
        assert torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8))
