"""deepinfer.kernels_nvidia: Triton kernels for NVIDIA GPUs, found through the
``deepinfer.backends`` entry point as :data:`backend`.

Importing this package imports neither triton nor any kernel module; ``backend.ops`` does, the
first time the engine asks for an op. Each kernel module decorates its entry functions with
:func:`deepinfer.kernels_nvidia.registry.implements`.
"""

from __future__ import annotations

import importlib
import pkgutil

from deepinfer.kernels import API_VERSION, Backend
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS
from deepinfer.kernels_nvidia.version import __version__

_NOT_KERNELS = {"registry", "version"}


def _is_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _unavailable_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    return "no CUDA device is visible (torch.cuda.is_available() is False)"


def _load_ops():
    modules = pkgutil.walk_packages(__path__, prefix=f"{__name__}.")
    for info in sorted(modules, key=lambda m: m.name):
        if info.name.rsplit(".", 1)[-1] not in _NOT_KERNELS:
            importlib.import_module(info.name)
    return dict(IMPLEMENTATIONS)


backend = Backend(
    name="nvidia-triton",
    accelerator="nvidia",
    api_version=API_VERSION,
    device_type="cuda",
    is_available=_is_available,
    unavailable_reason=_unavailable_reason,
    load_ops=_load_ops,
)

__all__ = ["__version__", "backend"]
