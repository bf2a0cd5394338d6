"""Backend discovery, accelerator selection, dispatch and fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels import registry


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch):
    monkeypatch.setattr(registry, "_active", None)
    registry._resolve_cached.cache_clear()
    registry._logged_fallbacks.clear()
    yield
    monkeypatch.setattr(registry, "_active", None)
    registry._resolve_cached.cache_clear()


def _entry_point(backend):
    class EP:
        value = f"fake:{backend.name}"

        def load(self):
            return backend

    return EP()


@pytest.fixture
def fake_plugins(monkeypatch):
    """Install fake nvidia/ascend plugins (unavailable here) through the entry-point lookup."""
    nvidia = _fake_backend({"rms_norm": lambda *a, **k: None}, device_type="cuda")
    nvidia.is_available = lambda: False
    nvidia.unavailable_reason = lambda: "no CUDA device is visible"
    ascend = kernels.Backend(
        name="fake-ascend",
        accelerator="ascend",
        api_version=kernels.API_VERSION,
        device_type="npu",
        is_available=lambda: False,
        unavailable_reason=lambda: "torch_npu is not installed",
        load_ops=dict,
    )
    eps = [_entry_point(nvidia), _entry_point(ascend)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: eps)
    registry.discover_backends.cache_clear()
    yield {"nvidia": nvidia, "ascend": ascend}
    registry.discover_backends.cache_clear()


def test_backends_are_discovered_through_entry_points(fake_plugins):
    backends = kernels.discover_backends()
    assert backends["cpu"] is kernels.REFERENCE
    assert backends["nvidia"] is fake_plugins["nvidia"]
    assert backends["ascend"] is fake_plugins["ascend"]


def test_cpu_selected_by_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    sel = kernels.select_accelerator()
    assert sel.accelerator == "cpu" and sel.backend is kernels.REFERENCE
    assert "DEEPINFER_ACCELERATOR" in sel.reason


def test_explicit_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    assert kernels.select_accelerator("cpu").accelerator == "cpu"


def test_missing_ascend_fails_with_one_clear_line(monkeypatch, fake_plugins):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(kernels.AcceleratorUnavailableError) as err:
        kernels.select_accelerator()
    message = str(err.value)
    assert "\n" not in message
    assert "ascend" in message and "torch_npu" in message


def test_unavailable_nvidia_fails_clearly(monkeypatch, fake_plugins):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    with pytest.raises(kernels.AcceleratorUnavailableError, match="nvidia.*CUDA"):
        kernels.select_accelerator()


def test_unknown_accelerator_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="DEEPINFER_ACCELERATOR='tpu'.*nvidia, ascend or cpu"):
        kernels.select_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="detection would pick nvidia")
def test_detection_without_devices_is_cpu(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    sel = kernels.select_accelerator()
    assert sel.accelerator == "cpu" and sel.backend is kernels.REFERENCE


def test_cpu_runs_everything_on_the_reference(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    x, w = torch.randn(5, 32), torch.randn(32)
    for name in kernels.OPS:
        assert kernels.resolve(name, (x,)) is kernels.OPS[name].reference
    torch.testing.assert_close(
        kernels.rms_norm(x, w, 1e-6), kernels.OPS["rms_norm"].reference(x, w, 1e-6)
    )


def _fake_backend(ops, api_version=kernels.API_VERSION, device_type="cpu"):
    return kernels.Backend(
        name="fake",
        accelerator="nvidia",
        api_version=api_version,
        device_type=device_type,
        is_available=lambda: True,
        unavailable_reason=lambda: "",
        load_ops=lambda: dict(ops),
    )


def test_dispatch_uses_native_op_and_falls_back_once_logged(monkeypatch, caplog):
    calls = []

    def native_rms_norm(x, weight, eps, *, out=None):
        calls.append(x.shape)
        return kernels.OPS["rms_norm"].reference(x, weight, eps, out=out)

    fake = _fake_backend({"rms_norm": native_rms_norm})
    monkeypatch.setattr(registry, "_active", kernels.Selection("nvidia", fake, "test"))
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    kernels.rms_norm(x, w, 1e-6)
    assert calls == [torch.Size([3, 16])]
    with caplog.at_level(logging.INFO, logger="deepinfer.kernels"):
        for _ in range(3):
            kernels.fused_add_rms_norm(x, r, w, 1e-6)
    fallback_lines = [m for m in caplog.messages if "fused_add_rms_norm" in m and "reference" in m]
    assert len(fallback_lines) == 1


def test_native_op_skipped_for_inputs_on_another_device(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a cuda kernel must not receive cpu tensors")

    fake = _fake_backend({"rms_norm": never}, device_type="cuda")
    monkeypatch.setattr(registry, "_active", kernels.Selection("nvidia", fake, "test"))
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(
        kernels.rms_norm(x, w, 1e-6), kernels.OPS["rms_norm"].reference(x, w, 1e-6)
    )


def test_reference_ops_variable_bypasses_the_backend(monkeypatch):
    calls = []

    def native_rms_norm(x, weight, eps, *, out=None):
        calls.append(x.shape)
        return torch.zeros_like(x)  # visibly not the reference

    fake = _fake_backend({"rms_norm": native_rms_norm})
    monkeypatch.setattr(registry, "_active", kernels.Selection("nvidia", fake, "test"))
    x, w = torch.randn(2, 8), torch.randn(8)
    monkeypatch.setenv("DEEPINFER_REFERENCE_OPS", "1")
    torch.testing.assert_close(
        kernels.rms_norm(x, w, 1e-6), kernels.OPS["rms_norm"].reference(x, w, 1e-6)
    )
    assert calls == []
    monkeypatch.setenv("DEEPINFER_REFERENCE_OPS", "0")
    assert torch.count_nonzero(kernels.rms_norm(x, w, 1e-6)) == 0
    assert calls == [torch.Size([2, 8])]


def test_backend_with_other_api_version_is_ignored(monkeypatch, caplog):
    class EP:
        value = "fake:backend"

        def load(self):
            return _fake_backend({}, api_version=kernels.API_VERSION + 1)

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [EP()])
    registry.discover_backends.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deepinfer.kernels"):
            found = registry.discover_backends()
        assert set(found) == {"cpu"}
        assert any("op API" in m for m in caplog.messages)
    finally:
        registry.discover_backends.cache_clear()


def test_backend_claiming_unknown_op_is_rejected():
    fake = _fake_backend({"no_such_op": lambda: None})
    with pytest.raises(RuntimeError, match="no_such_op"):
        fake.ops  # noqa: B018


def test_not_installed_backend_fails_clearly(monkeypatch):
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    registry.discover_backends.cache_clear()
    try:
        with pytest.raises(
            kernels.AcceleratorUnavailableError, match="kernels-nvidia backend is not installed"
        ):
            kernels.select_accelerator("nvidia")
    finally:
        registry.discover_backends.cache_clear()


def test_implementation_table_lists_every_op_per_backend(fake_plugins):
    rows = dict(kernels.implementation_table())
    assert set(rows) == set(kernels.OPS)
    assert rows["rms_norm"]["nvidia"] == "native"
    assert rows["rms_norm"]["cpu"] == "reference"
    assert rows["rms_norm"]["ascend"] == "reference fallback"
    assert rows["fused_add_rms_norm"]["nvidia"] == "reference fallback"
