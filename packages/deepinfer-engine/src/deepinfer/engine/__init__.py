"""deepinfer.engine: the DeepSeek-V4 model family and the offline inference engine.

from deepinfer.engine import LLM, SamplingParams

llm = LLM("path/or/hub-id")
outputs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))
"""

from deepinfer.engine.core import (
    CompletionOutput,
    InvalidRequestError,
    RequestMetrics,
    RequestOutput,
)
from deepinfer.engine.llm import LLM, RequestStream
from deepinfer.engine.version import __version__
from deepinfer.sampling import SamplingParams, StructuredOutputs

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputs",
    "__version__",
]
