"""deepinfer.engine: the DeepSeek-V4 model family and the offline inference engine.

    from deepinfer.engine import LLM, SamplingParams

    llm = LLM("path/or/hub-id")
    outputs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))

The public names load lazily, so importing a torch-free part (``deepinfer.engine.core``'s
scheduler and block manager) does not import torch.
"""

from deepinfer.engine.lazy import lazy_exports
from deepinfer.engine.version import __version__

_EXPORTS = {
    "LLM": "deepinfer.engine.frontend.llm",
    "RequestStream": "deepinfer.engine.frontend.llm",
    "CompletionOutput": "deepinfer.engine.frontend.outputs",
    "RequestMetrics": "deepinfer.engine.frontend.outputs",
    "RequestOutput": "deepinfer.engine.frontend.outputs",
    "InvalidRequestError": "deepinfer.engine.frontend.validation",
    "SamplingParams": "deepinfer.sampling",
    "StructuredOutputs": "deepinfer.sampling",
}

__all__ = [*_EXPORTS, "__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, eager=["__version__"])
