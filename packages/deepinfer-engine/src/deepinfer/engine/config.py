"""``LLM`` constructor arguments, validated and resolved once into a frozen ``EngineConfig``.

What the model side reports back after loading and profiling (vocabulary, EOS ids, context
limit, compression ratios, cache capacity) is a ``LoadedModel``; ``max_model_len`` is settled
only then, against the cache capacity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.executor import Executor

logger = logging.getLogger("deepinfer.engine")

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
ACCELERATORS = ("auto", "nvidia", "ascend", "cpu")
DTYPES = ("bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
SPEC_ACCEPTANCE = ("auto", "seed_exact", "rejection")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, resolved (``max_model_len`` may stay None until the model loads).

    Speculative decoding (DSpark, checkpoints with draft stages): ``speculative_tokens``
    drafts per decode step (None: ``DEEPINFER_USE_NEXTN_DECODE``; 0: off), checked against the
    checkpoint's ``dspark_block_size`` at load; ``spec_acceptance`` how sampled requests verify
    drafts (``"auto"``: seed-exact when the user gave a seed, else rejection sampling);
    ``spec_varlen`` confidence-scheduled verification (None: ``DEEPINFER_ENABLE_MTP_VARLEN``);
    ``spec_cost_curve`` the planner's step-cost curve (None: measured at start-up);
    ``return_draft_confidences`` report the drafts' confidences in ``RequestOutput.metrics``.
    ``enforce_eager``: never replay decode-step CUDA graphs (on a CUDA device without
    speculation, decode-only steps replay them by default).
    """

    model: str
    accelerator: str = "auto"
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    quant_simulation: bool | None = None
    seed: int = 0
    block_size: int = 128
    enable_chunked_prefill: bool = True
    num_cache_blocks: int | None = None
    speculative_tokens: int | None = None
    spec_acceptance: str = "auto"
    spec_varlen: bool | None = None
    spec_cost_curve: Any = None
    return_draft_confidences: bool = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _check_choice("accelerator", self.accelerator, ACCELERATORS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _check_positive_int(name, getattr(self, name))
        if self.max_model_len is not None:
            _check_positive_int("max_model_len", self.max_model_len)
        if self.num_cache_blocks is not None:
            _check_positive_int("num_cache_blocks", self.num_cache_blocks)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an integer")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization={util!r}: expected a number in (0, 1]")
        if self.quant_simulation not in (None, True, False):
            raise ValueError(
                f"quant_simulation={self.quant_simulation!r}: expected None, True or False"
            )
        self._check_speculation()
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r}: expected a bool")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r}: expected a hub id or a directory")

    def _check_speculation(self) -> None:
        k = self.speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(
                f"speculative_tokens={k!r}: expected None (DEEPINFER_USE_NEXTN_DECODE) or an "
                "integer >= 0 (0 disables speculation)"
            )
        _check_choice("spec_acceptance", self.spec_acceptance, SPEC_ACCEPTANCE)
        for name in ("spec_varlen",):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected None, True or False")
        if not isinstance(self.return_draft_confidences, bool):
            raise ValueError(
                f"return_draft_confidences={self.return_draft_confidences!r}: expected a bool"
            )
        curve = self.spec_cost_curve
        if curve is not None and not callable(getattr(curve, "costs", None)):
            raise ValueError(
                f"spec_cost_curve={curve!r}: expected a deepinfer.spec.StepCostCurve or None"
            )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")


@dataclass(frozen=True)
class LoadedModel:
    """What loading (weights, tokenizer, profile run, cache allocation) gives the engine.

    num_blocks / num_state_slots: cache capacity, reserved id 0 included.
    compression_ratios: the model's KV compression ratios (the block size must be a
        multiple of each).
    """

    executor: Executor
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    num_blocks: int
    num_state_slots: int
    compression_ratios: tuple[int, ...] = (1,)


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """Settle ``max_model_len``: the user's value, checked, or the model's limit capped by
    the cache capacity."""
    capacity = (loaded.num_blocks - 1) * config.block_size
    limit = loaded.max_position_embeddings
    if config.max_model_len is None:
        return replace(config, max_model_len=min(limit, capacity))
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len}: expected at most the model's "
            f"max_position_embeddings={limit}"
        )
    if config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len={config.max_model_len}: the KV cache holds only {capacity} tokens "
            f"({loaded.num_blocks - 1} blocks of {config.block_size}); raise "
            "gpu_memory_utilization or lower max_model_len"
        )
    return config


def scheduler_config(config: EngineConfig, loaded: LoadedModel) -> SchedulerConfig:
    """The scheduler's sub-config (``max_model_len`` must be resolved)."""
    assert config.max_model_len is not None
    num_slots = min(loaded.num_state_slots, config.max_num_seqs + 1)
    return SchedulerConfig(
        max_num_seqs=min(config.max_num_seqs, num_slots - 1),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        num_blocks=loaded.num_blocks,
        block_size=config.block_size,
        num_state_slots=num_slots,
        enable_chunked_prefill=config.enable_chunked_prefill,
        compression_ratios=loaded.compression_ratios,
    )


def log_capacity(config: SchedulerConfig) -> None:
    """The start-up line: cache capacity in tokens and sequences."""
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens; %d state slots (max %d sequences); "
        "max_model_len %d, %d batched tokens per step",
        config.num_blocks - 1,
        config.block_size,
        (config.num_blocks - 1) * config.block_size,
        config.num_state_slots - 1,
        config.max_num_seqs,
        config.max_model_len,
        config.max_num_batched_tokens,
    )
