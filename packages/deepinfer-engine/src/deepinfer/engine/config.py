"""The engine's configuration: one declaration of every engine parameter, resolved once.

:class:`EngineConfig`'s fields are the parameters: their defaults, the help text, the check of
a value and the command-line flag live in each field's metadata, and ``LLM``'s keyword
arguments, its docstring and the ``deepinfer generate / chat`` flags are derived from them.
Values left to the environment (``model``, ``speculative_tokens``, ``spec_varlen``) and
``max_num_batched_tokens`` are settled when the config is built, the argument beating the
environment, so everything downstream reads plain values.

What the model side reports back after loading and profiling (vocabulary, EOS ids, context
limit, compression ratios, cache capacity) is a ``LoadedModel``; ``max_model_len`` is settled
only then, against the cache capacity.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from deepinfer.engine import param_checks as checks
from deepinfer.engine.core.config import SchedulerConfig
from deepinfer.engine.core.executor import Executor
from deepinfer.kernels import envs
from deepinfer.parallel import ParallelConfig

logger = logging.getLogger("deepinfer.engine")

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
ACCELERATORS = ("auto", "nvidia", "ascend", "cpu")
DTYPES = ("bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
SPEC_ACCEPTANCE = ("auto", "seed_exact", "rejection")
NUMERICS = ("model", "float")
REMEASURE = "remeasure"  # spec_cost_curve: measure the curve again instead of reading it back
# Parameters that are gone, with what replaces them (named in the error).
REMOVED_PARAMETERS = {
    "quant_simulation": "numerics ('model', the default: the roundings the model defines; "
    "'float': none)",
}


def param(
    default: Any,
    help: str,
    check: Callable[[str, Any], None] | None = None,
    *,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
    cli_type: Callable[[str], Any] | None = None,
    cli_alias: str | None = None,
) -> Any:
    """A parameter of the engine: a dataclass field whose metadata holds its help text, its
    check (``check(name, value)`` raises ValueError naming the field) and its command-line
    flag (``cli``; the flag is ``--`` plus the name with dashes, of type ``cli_type``, plus the
    short ``cli_alias`` if given)."""
    if choices is not None and check is None:
        check = checks.choice(choices)
    metadata = {"help": help, "check": check, "choices": choices, "cli": cli, "type": cli_type}
    metadata["alias"] = cli_alias
    return field(default=default, metadata=metadata)


def _internal(default: Any, help: str) -> Any:
    """A resolved fact that is not a user parameter (no keyword of ``LLM``, no flag)."""
    return field(default=default, metadata={"help": help, "internal": True})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, resolved (``max_model_len`` may stay None until the model loads).

    Built from ``LLM``'s arguments; each field's metadata says what it means.
    """

    model: str | None = param(
        None,
        "a hub id or a local checkpoint directory; None means ``DEEPINFER_HF_MODEL_DIR`` if "
        f"set, else ``{DEFAULT_MODEL}``.",
        checks.model_name,
    )
    accelerator: str = param(
        "auto",
        "where to run, ``auto | nvidia | ascend | cpu`` (auto: ``DEEPINFER_ACCELERATOR``, else "
        "detect).",
        choices=ACCELERATORS,
    )
    dtype: str = param(
        "bfloat16",
        "activation dtype, ``bfloat16 | float16 | float32`` (the command line defaults to "
        "float32 on cpu).",
        choices=DTYPES,
    )
    max_model_len: int | None = param(
        None,
        "most tokens (prompt + output) per sequence; None = the model's limit capped by the "
        "KV-cache capacity.",
        checks.optional_positive_int,
        cli_type=int,
    )
    max_num_seqs: int = param(
        256, "most sequences running at once.", checks.positive_int, cli_type=int
    )
    max_num_batched_tokens: int | None = param(
        None,
        f"token budget per step (None = {DEFAULT_MAX_NUM_BATCHED_TOKENS}, or ``max_model_len`` "
        "when chunked prefill is off).",
        checks.optional_positive_int,
        cli_type=int,
    )
    gpu_memory_utilization: float = param(
        0.9,
        "fraction of device memory for this engine's weights, activations and cache (other "
        "processes on the device do not count against it; the cache never takes more than is "
        "free).",
        checks.fraction,
        cli_type=float,
    )
    load_format: str = param(
        "auto",
        "``auto`` (the checkpoint's weights) or ``dummy`` (random weights of the real shapes).",
        choices=LOAD_FORMATS,
    )
    numerics: str = param(
        "model",
        "``model``: the roundings the model defines (FP8 / FP4 cache and indexer formats, FP8 "
        "inputs of FP8 / FP4 linears); ``float``: none of them, a floating-point debug path.",
        choices=NUMERICS,
    )
    seed: int = param(
        0,
        "seeds the engine's random state and the per-request seeds of requests that set none "
        "(so a rerun of the same script reproduces them).",
        checks.integer,
        cli=False,  # the command line's --seed is the sampling seed
    )
    block_size: int = param(128, "tokens per KV-cache block.", checks.positive_int, cli_type=int)
    enable_chunked_prefill: bool = param(True, "split long prompts across steps.", checks.boolean)
    num_cache_blocks: int | None = param(
        None,
        "use this many KV-cache blocks instead of the number that fits in memory "
        "(reproducible capacity; small values force preemption in tests).",
        checks.optional_positive_int,
        cli_type=int,
    )
    speculative_tokens: int | None = param(
        None,
        "DSpark drafts per decode step (None: ``DEEPINFER_USE_NEXTN_DECODE``, default 5, capped "
        "at the checkpoint's ``dspark_block_size``; 0: no speculation). Only checkpoints with "
        "DSpark draft stages speculate.",
        checks.draft_count,
        cli_type=int,
    )
    spec_acceptance: str = param(
        "auto",
        "how sampled requests verify drafts: ``auto`` (seed-exact when the request sets a "
        "seed, so its tokens equal a run without speculation; rejection sampling otherwise, "
        "exact in distribution), ``seed_exact`` or ``rejection``. Greedy requests always take "
        "the argmax prefix.",
        choices=SPEC_ACCEPTANCE,
    )
    spec_varlen: bool | None = param(
        None,
        "confidence-scheduled verification (each request verifies the drafts worth their "
        "cost); None: ``DEEPINFER_ENABLE_MTP_VARLEN``.",
        checks.optional_bool,
    )
    spec_cost_curve: Any = param(
        None,
        "the ``deepinfer.spec.StepCostCurve`` that planning uses; None: the one stored for this "
        "GPU, model and configuration, else measured at start-up; ``'remeasure'``: measured.",
        checks.cost_curve,
        cli=False,
    )
    return_draft_confidences: bool = param(
        False,
        "report each verified draft's confidence in ``RequestOutput.metrics.draft_confidences``.",
        checks.boolean,
        cli=False,
    )
    enforce_eager: bool = param(
        False,
        "run every step eagerly. By default, on a CUDA device without speculation, decode-only "
        "steps (one token per sequence) replay CUDA graphs captured on first use per (batch "
        "size, context bucket); outputs are identical.",
        checks.boolean,
    )
    async_scheduling: bool | None = param(
        None,
        "asynchronous (zero-overhead) scheduling: the host prepares step N+1 while the device "
        "runs step N, whose sampled tokens feed N+1 there (spawned data-parallel ranks too; "
        "torchrun ranks step synchronously); stops apply one step late, what ran past them is "
        "dropped (outputs unchanged). None: ``DEEPINFER_ZERO_OVERHEAD_SCHEDULING`` (default on).",
        checks.optional_bool,
    )
    data_parallel_size: int = param(
        1,
        "attention data parallelism: this many worker processes (one per device; on a CPU, "
        "processes over gloo), each with its own requests, KV cache and scheduler, stepping "
        "in lockstep. Under ``torchrun`` the launched processes are the ranks.",
        checks.positive_int,
        cli_type=int,
        cli_alias="-dp",
    )
    expert_parallel_size: int = param(
        1,
        "MoE expert parallelism over the data-parallel ranks: 1 (every rank holds every "
        "expert) or ``data_parallel_size``.",
        checks.positive_int,
        cli_type=int,
        cli_alias="-ep",
    )
    context_parallel_size: int = param(
        1,
        "ranks that prefill a prompt of ``cp_min_tokens`` or more together, each computing its "
        "share of the rows (context parallelism, engine README); a divisor of the DP ranks.",
        cli_type=int,
        cli_alias="-cp",
    )
    cp_min_tokens: int = param(
        4096,
        "with ``context_parallel_size`` > 1: the shortest prompt a CP group prefills (shorter "
        "ones, and every decode step, run on the DP rank that owns the request).",
        checks.positive_int,
        cli_type=int,
    )
    num_redundant_experts: int = param(
        0,
        "with expert parallelism: extra expert slots on each rank, holding replicas of the "
        "most loaded experts (chosen by EPLB).",
        checks.optional_count,
        cli_type=int,
    )
    eplb_interval: int = param(
        0,
        "with expert parallelism: rebalance the experts over the ranks every this many steps, "
        "between steps, by the load of the last ``eplb_window`` steps (0: never).",
        checks.optional_count,
        cli_type=int,
    )
    eplb_window: int = param(
        100, "steps of per-expert load EPLB balances.", checks.positive_int, cli_type=int
    )
    distributed_timeout_s: float = param(
        60.0,
        "with ``data_parallel_size`` > 1: the longest a step may take before the call raises "
        "naming the late rank (loading gets 30 times as long).",
        checks.positive_number,
        cli=False,
    )
    yoco_prefill_truncation_mode: str | None = param(
        None,
        "SWA bounded replay, YoCo prefill truncation (V4.1 only; an approximation, spec 4.5): "
        "``off | mask | compact``; None: ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE`` (default "
        "off). ``compact`` runs the consumer layers (the first ratio-1 layer on) only on each "
        "prompt's last ``yoco_prefill_keep_tokens`` rows, whose windows then start there; "
        "``mask`` runs every row with those windows (to validate compact). A request asking "
        "for prompt logprobs fails alone while it is on.",
        checks.optional_truncation_mode,
        cli_type=str,
    )
    yoco_prefill_keep_tokens: int | None = param(
        None,
        "prompt rows the consumer layers keep under truncation, at least ``sliding_window`` + "
        "speculative tokens; None: ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``; 0: that least value.",
        checks.optional_count,
        cli_type=int,
    )
    cap_speculative_tokens: bool = _internal(
        False,
        "``speculative_tokens`` came from ``DEEPINFER_USE_NEXTN_DECODE``: a preference capped "
        "at the checkpoint's draft block (and ignored without draft stages), not a requirement.",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None and f.name != "model":
                check(f.name, getattr(self, f.name))
        self.parallel_config()  # refuses an impossible layout, naming the field
        self._resolve()
        checks.model_name("model", self.model)
        checks.positive_int("max_num_batched_tokens", self.max_num_batched_tokens)

    def _resolve(self) -> None:
        """Settle the values left to the environment or to other fields (argument first)."""
        resolved: dict[str, Any] = {}
        if not isinstance(self.model, str):
            resolved["model"] = resolve_model(self.model)
        if self.max_num_batched_tokens is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill and self.max_model_len is not None:
                budget = max(self.max_model_len, budget)
            resolved["max_num_batched_tokens"] = budget
        if self.speculative_tokens is None:
            k = envs.get("DEEPINFER_USE_NEXTN_DECODE")
            if k < 0:
                raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={k}: expected >= 0")
            resolved.update(speculative_tokens=k, cap_speculative_tokens=True)
        if self.spec_varlen is None:
            resolved["spec_varlen"] = bool(envs.get("DEEPINFER_ENABLE_MTP_VARLEN"))
        if self.async_scheduling is None:
            resolved["async_scheduling"] = envs.get("DEEPINFER_ZERO_OVERHEAD_SCHEDULING")
        if self.yoco_prefill_truncation_mode is None:
            mode = envs.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
            resolved["yoco_prefill_truncation_mode"] = mode
        if self.yoco_prefill_keep_tokens is None:
            keep = envs.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
            if keep < 0:
                raise ValueError(f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={keep}: expected >= 0")
            resolved["yoco_prefill_keep_tokens"] = keep
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: settled once, here

    def parallel_config(self) -> ParallelConfig:
        """The data / expert parallel layout of this engine."""
        return ParallelConfig(
            data_parallel_size=self.data_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            context_parallel_size=self.context_parallel_size,
            num_redundant_experts=self.num_redundant_experts,
            eplb_interval=self.eplb_interval,
            eplb_window=self.eplb_window,
        )

    @classmethod
    def parameters(cls) -> list[Any]:
        """The user parameters (``LLM``'s keyword arguments), in declaration order."""
        return [f for f in fields(cls) if not f.metadata.get("internal")]


def resolve_model(model: Any) -> str:
    """``model``, else ``DEEPINFER_HF_MODEL_DIR``, else the default hub id."""
    if model is not None:
        return str(model)
    return envs.get("DEEPINFER_HF_MODEL_DIR") or DEFAULT_MODEL


@dataclass(frozen=True)
class LoadedModel:
    """What loading (weights, tokenizer, profile run, cache allocation) gives the engine.

    num_blocks / num_state_slots: cache capacity, reserved id 0 included.
    compression_ratios: the model's KV compression ratios (the block size must be a
        multiple of each).
    vision: the V4.1 image settings (``model.vision_config.ImageSettings``) of a model with a
        vision tower, None without one.
    """

    executor: Executor
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    num_blocks: int
    num_state_slots: int
    compression_ratios: tuple[int, ...] = (1,)
    vision: Any = None


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
