"""Without a CUDA device, run the Triton kernels under the interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates, so it is set here, before any test
module imports a kernel module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from deepinfer.kernels.testing import patch_triton_interpreter

    patch_triton_interpreter()
