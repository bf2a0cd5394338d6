"""The model runner: loads a checkpoint, sizes and owns the cache, and executes scheduled steps
(the ``Executor`` of the engine core).

The names load lazily so that the torch-free parts (``batch_plan``, ``capacity``) import
without torch.
"""

from deepinfer.engine.lazy import lazy_exports

_EXPORTS = {
    "ModelRunner": "deepinfer.engine.runner.model_runner",
    "load_executor": "deepinfer.engine.runner.loading",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
