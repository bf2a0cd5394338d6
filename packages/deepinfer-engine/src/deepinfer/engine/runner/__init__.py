"""The model runner: loads a checkpoint, sizes and owns the cache, and executes scheduled steps
(the ``Executor`` of the engine core).

The names load lazily so that the torch-free parts (``batch_plan``, ``capacity``) import
without torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ModelRunner": "deepinfer.engine.runner.model_runner",
    "load_executor": "deepinfer.engine.runner.loading",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer.engine.runner' has no attribute {name!r}")
    return getattr(import_module(module), name)
