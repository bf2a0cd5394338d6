"""The kit must catch broken implementations, not only pass good ones."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels.testing import CASES, cases_for, check_case

REF = kernels.OPS["rms_norm"].reference
SMALL = cases_for(["rms_norm"], "small")


@pytest.mark.parametrize("case", cases_for(kernels.OPS, "small"), ids=str)
def test_reference_passes_its_own_kit(case):
    check_case(kernels.OPS[case.op].reference, case, "cpu")


def test_every_op_has_small_and_real_cases():
    for name in kernels.OPS:
        assert cases_for([name], "small"), f"no small conformance case for {name}"
        assert cases_for([name], "real"), f"no real-size conformance case for {name}"


def test_kit_catches_an_unwritten_last_row():
    def skips_last_row(x, weight, eps, *, out=None):
        y = REF(x, weight, eps)
        if out is None:
            return y
        out[:-1] = y[:-1]
        return out

    case = next(c for c in SMALL if c.name.startswith("7x"))
    with pytest.raises(AssertionError, match="poisoned"):
        check_case(skips_last_row, case, "cpu")


def test_kit_catches_ignoring_strides():
    def assumes_contiguous(x, weight, eps, *, out=None):
        flat = torch.as_strided(x, x.shape, (x.shape[1], 1))  # wrong for padded rows
        return REF(flat, weight, eps, out=out)

    case = next(c for c in SMALL if c.name.startswith("7x"))
    with pytest.raises(AssertionError, match="non-contiguous"):
        check_case(assumes_contiguous, case, "cpu")


def test_kit_catches_a_small_numeric_error_in_fp32():
    def off_by_eps(x, weight, eps, *, out=None):
        return REF(x, weight, eps * 1e4, out=out)

    case = next(c for c in SMALL if c.name.endswith("float32"))
    with pytest.raises(AssertionError):
        check_case(off_by_eps, case, "cpu", seed=0)


def test_kit_catches_a_write_that_stores_nothing():
    """An op that writes into an argument is compared on what the implementation wrote, not
    on what the reference wrote into the same tensor."""

    def writes_nothing(cache, dst, values, fmt):
        return cache

    case = cases_for(["write_rows"], "small")[0]
    with pytest.raises(AssertionError, match="allocating"):
        check_case(writes_nothing, case, "cpu")


def test_kit_catches_an_in_place_form_that_drops_the_passthrough():
    """``out=x`` must leave the channels it does not rotate as they were."""
    rope = kernels.OPS["apply_rope"].reference

    def zeroes_passthrough(x, cos, sin, *, inverse=False, out=None):
        result = rope(x, cos, sin, inverse=inverse, out=out)
        if out is x:
            out[..., : x.shape[-1] - 2 * cos.shape[-1]] = 0
        return result

    case = cases_for(["apply_rope"], "small")[0]
    with pytest.raises(AssertionError, match="in place"):
        check_case(zeroes_passthrough, case, "cpu")


def test_inputs_are_fresh_random_and_never_zero():
    case = SMALL[0]
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    (x1, *_), _ = case.make_inputs(g1, torch.device("cpu"))
    (x2, *_), _ = case.make_inputs(g2, torch.device("cpu"))
    assert x1.abs().min() > 0 or x1.count_nonzero() > x1.numel() * 0.99
    assert not torch.equal(x1, x2)
    assert len(CASES) >= len(SMALL)
