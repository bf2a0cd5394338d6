"""deepinfer.sampling: a standalone sampler with seeded determinism and structured outputs.

``sample(logits, params, positions)`` runs the documented pipeline of
:mod:`deepinfer.sampling.sampler`; :class:`GrammarCompilerService` and
:class:`StructuredOutputState` provide xgrammar-backed structured outputs. Nothing here depends
on the engine: any framework can drive it from its own generation loop.
"""

from deepinfer.sampling import graphs, rng
from deepinfer.sampling.compiler import (
    GrammarCompilerService,
    GrammarError,
    PendingGrammar,
    compiler_for_tokenizer,
)
from deepinfer.sampling.params import (
    GrammarSpec,
    SamplingParams,
    StructuredOutputs,
    resolve_seeds,
)
from deepinfer.sampling.sampler import SampleResult, prompt_logprobs, sample
from deepinfer.sampling.structured import (
    StructuredOutputState,
    allocate_token_bitmask,
    fill_bitmasks,
)
from deepinfer.sampling.version import __version__

__all__ = [
    "GrammarCompilerService",
    "GrammarError",
    "GrammarSpec",
    "PendingGrammar",
    "SampleResult",
    "SamplingParams",
    "StructuredOutputState",
    "StructuredOutputs",
    "__version__",
    "allocate_token_bitmask",
    "compiler_for_tokenizer",
    "fill_bitmasks",
    "graphs",
    "prompt_logprobs",
    "resolve_seeds",
    "rng",
    "sample",
]
