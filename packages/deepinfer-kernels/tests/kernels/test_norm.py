"""The reference RMSNorm against a direct transcription of the formula."""

from __future__ import annotations

import torch

from deepinfer import kernels


def test_reference_matches_formula_in_float64():
    x = torch.randn(9, 48, dtype=torch.float64)
    w = torch.randn(48, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    got = kernels.OPS["rms_norm"].reference(x.float(), w.float(), 1e-6)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_fused_add_returns_the_rounded_sum_and_its_norm():
    x = torch.randn(4, 64).bfloat16()
    r = torch.randn(4, 64).bfloat16()
    w = torch.rand(64) + 0.5
    normed, summed = kernels.OPS["fused_add_rms_norm"].reference(x, r, w, 1e-6)
    assert summed.dtype == torch.bfloat16
    torch.testing.assert_close(summed, (x.float() + r.float()).bfloat16())
    torch.testing.assert_close(normed, kernels.OPS["rms_norm"].reference(summed, w, 1e-6))
