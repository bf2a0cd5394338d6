"""deepinfer.kernels_ascend: the backend for Huawei Ascend NPUs.

It implements no op natively yet: every op runs the plain-PyTorch reference on the NPU (through
torch_npu), and ``deepinfer info`` lists each of them as a reference fallback. What it does
provide is the accelerator itself: detection, a clear error when no NPU is present, and the
entry point the native kernels will be added behind.
"""

from __future__ import annotations

import importlib.util

from deepinfer.kernels import API_VERSION, Backend
from deepinfer.kernels_ascend.version import __version__


def _has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _is_available() -> bool:
    if not _has_torch_npu():
        return False
    import torch
    import torch_npu  # noqa: F401  (registers the npu device with torch)

    return torch.npu.is_available()


def _unavailable_reason() -> str:
    if not _has_torch_npu():
        return "torch_npu is not installed, so no Ascend NPU can be used"
    return "torch_npu found no Ascend NPU (torch.npu.is_available() is False)"


backend = Backend(
    name="ascend",
    accelerator="ascend",
    api_version=API_VERSION,
    device_type="npu",
    is_available=_is_available,
    unavailable_reason=_unavailable_reason,
    load_ops=dict,
)

__all__ = ["__version__", "backend"]
