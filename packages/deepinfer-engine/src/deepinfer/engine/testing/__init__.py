"""Test fixtures shared by every package's tests: tiny configs and real-format checkpoints.

``make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=True, seed=0)`` writes a
random checkpoint exactly as the published ones are laid out (sharded safetensors with an
index, FP8 / FP4 / Engram formats when quantised, ``config.json``, ``generation_config.json``)
plus the tiny test tokenizer.
"""

from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.modules import module_with_tensors
from deepinfer.engine.testing.random_checkpoint import (
    make_random_checkpoint,
    random_state_dict,
    write_testing_tokenizer,
)
from deepinfer.engine.testing.writer import with_quantization, write_checkpoint

__all__ = [
    "make_random_checkpoint",
    "module_with_tensors",
    "random_state_dict",
    "tiny_v41_config",
    "tiny_v4_config",
    "with_quantization",
    "write_checkpoint",
    "write_testing_tokenizer",
]
