"""Test fixtures shared by every package's tests: tiny configs, real-format checkpoints, and
drivers and fakes for the engine.

``make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=0)`` writes a
random checkpoint exactly as the published ones are laid out (sharded safetensors with an
index, FP8 / FP4 / Engram formats when quantised, ``config.json``, ``generation_config.json``)
plus the tiny test tokenizer. The submodules hold the rest: :mod:`.fake_executor` (a torch-free
executor and tokenizer for the engine core), :mod:`.oracle_drafts` (a scripted draft source),
:mod:`.simple_runner` (the model driven outside the engine).

The names load lazily so that the torch-free fakes import without torch.
"""

from deepinfer.engine.lazy import lazy_exports

_EXPORTS = {
    "make_random_checkpoint": "deepinfer.engine.testing.random_checkpoint",
    "module_with_tensors": "deepinfer.engine.testing.modules",
    "python_prompts": "deepinfer.engine.testing.prompts",
    "random_state_dict": "deepinfer.engine.testing.random_checkpoint",
    "tiny_v41_config": "deepinfer.engine.testing.configs",
    "tiny_v4_config": "deepinfer.engine.testing.configs",
    "with_quantization": "deepinfer.engine.testing.writer",
    "write_checkpoint": "deepinfer.engine.testing.writer",
    "write_testing_tokenizer": "deepinfer.engine.testing.random_checkpoint",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
