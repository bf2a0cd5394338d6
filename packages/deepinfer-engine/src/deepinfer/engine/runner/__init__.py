"""The model runner: loads a checkpoint, sizes and owns the cache, and executes scheduled steps
(the ``Executor`` of the engine core)."""

from deepinfer.engine.runner.loading import load_model
from deepinfer.engine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner", "load_model"]
