"""deepinfer.kernels: the op API of DeepInfer.

Every op is a plain function with a written contract (its docstring) and a plain-PyTorch
reference twin. Calls go to the active backend (found through the ``deepinfer.backends``
entry-point group) when it implements the op, else to the reference.
"""

from deepinfer.kernels import envs
from deepinfer.kernels.formats import PackedRows, RowFormat
from deepinfer.kernels.ops import *  # noqa: F403
from deepinfer.kernels.ops import __all__ as _op_names
from deepinfer.kernels.registry import (
    OPS,
    REFERENCE,
    AcceleratorUnavailableError,
    Backend,
    Selection,
    active,
    discover_backends,
    implementation_table,
    op,
    resolve,
    select_accelerator,
    set_accelerator,
)
from deepinfer.kernels.version import API_VERSION, __version__

__all__ = [
    "API_VERSION",
    "OPS",
    "PackedRows",
    "REFERENCE",
    "RowFormat",
    "AcceleratorUnavailableError",
    "Backend",
    "Selection",
    "__version__",
    "active",
    "discover_backends",
    "envs",
    "implementation_table",
    "op",
    "resolve",
    "select_accelerator",
    "set_accelerator",
    *_op_names,
]
