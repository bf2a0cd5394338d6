"""The Ascend backend: registered, honest about having no native op, clear when no NPU."""

from __future__ import annotations

import importlib.util

import pytest

from deepinfer import kernels
from deepinfer.kernels_ascend import backend

HAS_NPU = importlib.util.find_spec("torch_npu") is not None


def test_registered_under_the_entry_point_group():
    assert kernels.discover_backends()["ascend"] is backend
    assert backend.api_version == kernels.API_VERSION


def test_implements_no_op_natively_so_every_op_falls_back():
    assert backend.ops == {}
    rows = dict(kernels.implementation_table())
    assert all(row["ascend"] == "reference fallback" for row in rows.values())


@pytest.mark.skipif(HAS_NPU, reason="needs a machine without torch_npu")
def test_without_torch_npu_it_is_unavailable_with_a_reason():
    assert backend.is_available() is False
    assert "torch_npu is not installed" in backend.unavailable_reason()
