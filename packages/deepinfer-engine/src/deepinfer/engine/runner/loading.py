"""``load_executor``: from an ``EngineConfig`` to a running executor with its cache.

Steps: select the accelerator (the argument beats ``DEEPINFER_ACCELERATOR``) -> resolve the
checkpoint (directory, ``DEEPINFER_HF_MODEL_DIR`` or hub id) -> parse ``config.json`` -> decide
speculation (:func:`~deepinfer.engine.runner.speculation.resolve_spec_config`) -> build the
model on the device, with its DSpark draft stages when speculating, and fill it (validated
streaming load, or ``load_format="dummy"``) -> profile one forward of
``max_num_batched_tokens`` tokens to measure activation memory -> size the cache from what is
left of ``gpu_memory_utilization`` (a RAM budget on CPU; state slots then hold every ring at
``window + K`` rows plus the draft stages' rings) -> allocate it -> with confidence-scheduled
verification and no given curve, measure the step-cost curve on the step graphs (or reuse the
one an earlier run stored for this GPU, model and configuration).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer import kernels
from deepinfer.engine.checkpoint import resolve_model_path
from deepinfer.engine.checkpoint.index import read_checkpoint_index
from deepinfer.engine.checkpoint.inventory_vision import checked_image_settings
from deepinfer.engine.checkpoint.loader import fill_tensors, load_into
from deepinfer.engine.checkpoint.model_loader import bind_engram_from_tokenizer
from deepinfer.engine.config import REMEASURE, EngineConfig, LoadedModel
from deepinfer.engine.distributed.shared_tables import host_tables_deferred, node_table_share
from deepinfer.engine.model.cache import CacheLayout, ModelCache, cache_footprint
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.moe import stack_grouped_experts
from deepinfer.engine.model.yoco import prefill_truncation
from deepinfer.engine.runner.cache_report import cache_lines
from deepinfer.engine.runner.capacity import (
    CacheCapacity,
    device_peak_bytes,
    plan_cache_capacity,
)
from deepinfer.engine.runner.cost_profile import step_cost_curve
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.runner.draft_graphs import DraftGraphs
from deepinfer.engine.runner.drafting import DSparkDraftSource
from deepinfer.engine.runner.ep_executor import ExpertParallelExecutor
from deepinfer.engine.runner.grammar import GrammarManager
from deepinfer.engine.runner.host_threads import limit_host_threads
from deepinfer.engine.runner.model_runner import ModelRunner
from deepinfer.engine.runner.speculation import SpecConfig, resolve_spec_config
from deepinfer.kernels import envs
from deepinfer.parallel import ExpertParallelContext, TorchDistributedComm
from deepinfer.parallel.context import check_context_parallel

logger = logging.getLogger("deepinfer.engine")

DEVICES = {"nvidia": "cuda", "ascend": "npu", "cpu": "cpu"}
CPU_CACHE_BUDGET = 4 * 2**30  # bytes: the most the cache takes on a CPU
PROFILE_TOKENS_CAP = 16384
MAX_GRAPH_BATCH = 256  # decode steps (and draft proposals) of more sequences run eagerly
MAX_GRAPH_TOKENS = 512  # verification steps of more tokens run eagerly
MAX_GRAPH_CONTEXT = 65536  # and steps with longer contexts (the GPU work dominates them)


def load_executor(config: EngineConfig) -> LoadedModel:
    selection = kernels.set_accelerator(config.accelerator)
    device = torch.device(DEVICES[selection.accelerator])
    path = resolve_model_path(config.model, weights=config.load_format != "dummy")
    dtype = getattr(torch, config.dtype)
    torch.manual_seed(config.seed)
    model_config: ModelConfig = load_config(path, numerics=config.numerics)
    check_context_parallel_model(config, model_config)
    spec = resolve_spec_config(
        config, model_config, has_draft_weights=_has_draft_weights(path, config.load_format)
    )
    max_draft = spec.num_draft_tokens if spec is not None else 0
    truncation = prefill_truncation(  # checked before any weight loads
        model_config,
        config.yoco_prefill_truncation_mode,
        config.yoco_prefill_keep_tokens,
        max_draft,
    )
    expert_parallel = expert_parallel_context(config)
    before = _memory_before_load(device)
    model = _build_and_fill(
        path, model_config, config, spec is not None, device, dtype, expert_parallel
    )
    tokenizer = _load_tokenizer(path)
    # speculative steps (verification, the drafter) take graphs unless DEEPINFER_SPEC_GRAPHS=0
    wanted = not config.enforce_eager and (spec is None or envs.get("DEEPINFER_SPEC_GRAPHS"))
    use_graphs = wanted and DecodeGraphs.supports(model, device)
    graph_batch = min(config.max_num_seqs * (1 + max_draft),
                      MAX_GRAPH_TOKENS if max_draft else MAX_GRAPH_BATCH)  # fmt: skip
    graph_requests = min(config.max_num_seqs, MAX_GRAPH_BATCH)
    graph_context = min(config.max_model_len or model_config.max_position_embeddings,
                        MAX_GRAPH_CONTEXT)  # fmt: skip
    reserve = 0
    if use_graphs:
        reserve = graph_reserve_bytes(model_config, config.block_size, graph_batch, graph_context)
        if max_draft:
            reserve += DraftGraphs.reserve_bytes(model_config, graph_requests, max_draft)
    num_blocks, num_slots = _size_cache(
        model, model_config, config, device, dtype, max_draft, reserve, before
    )
    layout = CacheLayout(num_blocks, num_slots, block_size=config.block_size, max_draft=max_draft)
    cache = ModelCache(model_config, layout, dtype=dtype, device=device)
    capacity = CacheCapacity(num_blocks, num_slots, config.block_size)
    logger.info("KV cache: %s; %s", capacity.describe(), "; ".join(
        cache_lines(model_config, block_size=config.block_size, max_draft=max_draft, dtype=dtype)
    ))  # fmt: skip
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(model, cache, max_batch_size=graph_batch, max_context=graph_context,
                              speculative=spec is not None)  # fmt: skip
    vocab = model_config.vocab_size
    grammar = GrammarManager(tokenizer, vocab) if tokenizer is not None else None
    ratios = tuple(sorted({r for r in model_config.compress_ratios if r > 0})) or (1,)
    drafter = None
    if spec is not None:
        model.mtp.allocate(cache)
        draft_graphs = None
        if graphs is not None:
            draft_graphs = DraftGraphs(model, cache, spec.num_draft_tokens,
                                       max_requests=graph_requests, pool=graphs.pool)  # fmt: skip
        drafter = DSparkDraftSource(model, cache, spec.num_draft_tokens, draft_graphs)
        spec = _with_cost_curve(spec, model, config, device, dtype, graphs)
        logger.info(
            "speculative decoding: DSpark, %d drafts per step, %s verification, acceptance %s",
            spec.num_draft_tokens,
            "confidence-scheduled" if spec.varlen else "fixed-length",
            spec.acceptance,
        )
    limit_host_threads(device)  # after loading, which may use every thread
    if truncation is not None:  # after profiling, which must measure every row's activations
        model.truncation = truncation
        logger.info(
            "YoCo prefill truncation: %s, layers %d+ compute the last %d rows of each prompt",
            truncation.mode,
            truncation.boundary,
            truncation.keep_tokens,
        )
    return LoadedModel(
        executor=_with_expert_parallel(
            ModelRunner(model, cache, grammar=grammar, spec=spec, drafter=drafter, graphs=graphs),
            model,
            config,
        ),
        tokenizer=tokenizer,
        vocab_size=vocab,
        eos_token_ids=_eos_ids(path, model_config, tokenizer),
        max_position_embeddings=model_config.max_position_embeddings,
        num_blocks=num_blocks,
        num_state_slots=num_slots,
        compression_ratios=ratios,
        vision=checked_image_settings(model, path),
    )


def check_context_parallel_model(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse context parallelism on a model without compressed attention, before any weight
    loads (one line naming the field)."""
    cp = config.context_parallel_size
    check_context_parallel(cp, config.data_parallel_size, model_config.compress_ratios)


def _has_draft_weights(path: Path, load_format: str) -> bool:
    """Whether the checkpoint stores draft stages (``mtp.*``); dummy weights always have them."""
    if load_format == "dummy":
        return True
    return any(name.startswith("mtp.") for name in read_checkpoint_index(path))


def expert_parallel_context(config: EngineConfig) -> ExpertParallelContext | None:
    """This rank's EP group (the default process group, whose ranks are the DP ranks), or None
    without expert parallelism."""
    if config.expert_parallel_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != config.expert_parallel_size:
        raise RuntimeError(
            f"expert_parallel_size={config.expert_parallel_size}: expected to run in a process "
            "group of that many ranks (LLM starts them; under torchrun, each launched process)"
        )
    return ExpertParallelContext.from_config(config.parallel_config(), TorchDistributedComm())


def _with_expert_parallel(runner: ModelRunner, model, config: EngineConfig):
    """Under expert parallelism, the runner that also steps when idle and runs EPLB."""
    if config.expert_parallel_size == 1:
        return runner
    return ExpertParallelExecutor(runner, model, config.eplb_interval)


def _build_and_fill(
    path,
    model_config,
    config: EngineConfig,
    include_mtp: bool,
    device,
    dtype,
    expert_parallel: ExpertParallelContext | None = None,
):
    """The model (with its draft stages when speculating), weights loaded (under expert
    parallelism only this rank's experts; with several ranks the host Engram tables once per
    node, in shared memory), Engram bound."""
    share = node_table_share(config.distributed_timeout_s, bool(model_config.engram_layer_ids))
    with host_tables_deferred() if share is not None else contextlib.nullcontext():
        model = build_model(
            model_config,
            device=device,
            dtype=dtype,
            include_mtp=include_mtp,
            expert_parallel=expert_parallel,
        )
    load = {"config": model_config, "load_format": config.load_format, "seed": config.seed}
    load_into(model, path, **load)
    if share is not None:  # the host Engram tables: one copy per node, in shared memory
        share.place(model, lambda tables: fill_tensors(tables, path, **load))
    bind_engram_from_tokenizer(model, path)
    stacked = stack_grouped_experts(model, device)
    if stacked:
        logger.info("MoE: %d layers run their FP4 experts as one grouped op", stacked)
    return model.eval()


def _with_cost_curve(
    spec: SpecConfig, model, config: EngineConfig, device, dtype, graphs: DecodeGraphs | None
) -> SpecConfig:
    """Confidence-scheduled verification needs a step-cost curve: the given one, else the one
    stored for this GPU, model and configuration, else (or with ``spec_cost_curve=
    "remeasure"``) measured on the step graphs."""
    remeasure = spec.cost_curve == REMEASURE
    if not spec.varlen or not (spec.cost_curve is None or remeasure):
        return replace(spec, cost_curve=None) if remeasure else spec
    max_tokens = min(
        config.max_num_batched_tokens,
        config.max_num_seqs * (spec.num_draft_tokens + 1),
        PROFILE_TOKENS_CAP,
    )
    curve = step_cost_curve(
        model,
        num_draft_tokens=spec.num_draft_tokens,
        max_tokens=max_tokens,
        block_size=config.block_size,
        dtype=dtype,
        device=device,
        graphs=graphs,
        remeasure=remeasure,
    )
    logger.info("step-cost curve (tokens -> ms): %s", dict(zip(curve.num_tokens, curve.cost)))
    return replace(spec, cost_curve=curve)


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists():
        logger.warning("%s has no tokenizer.json: only prompt_token_ids can be used", path)
        return None
    from deepinfer.engine.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _eos_ids(path: Path, model_config: ModelConfig, tokenizer) -> frozenset[int]:
    ids = set()
    if model_config.eos_token_id is not None:
        ids.add(model_config.eos_token_id)
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def graph_reserve_bytes(
    model_config: ModelConfig, block_size: int, max_batch_size: int, max_context: int
) -> int:
    """Device memory kept back from the cache for the decode graphs: their shared fp32 logits
    buffer and int64 input buffer, plus their pool, which holds the activations of one decode
    forward of at most ``max_batch_size`` tokens (256 MiB per 256 tokens is ample)."""
    layout = CacheLayout(num_blocks=2, num_slots=2, block_size=block_size)
    inputs = DecodeGraphs.input_elements(model_config, layout, max_batch_size, max_context)
    pool = 256 * 2**20 * -(-max_batch_size // 256)
    return max_batch_size * model_config.vocab_size * 4 + inputs * 8 + pool


def _memory_before_load(device) -> tuple[int, int]:
    """(free device bytes, bytes this process's allocator holds) before the weights load; zeros
    off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


def _size_cache(
    model,
    model_config,
    config: EngineConfig,
    device,
    dtype,
    max_draft: int = 0,
    reserve: int = 0,
    before: tuple[int, int] = (0, 0),
) -> tuple[int, int]:
    """(num_blocks, num_state_slots), each including the reserved id 0 (see
    :func:`plan_cache_capacity`); never more blocks than ``max_num_seqs`` full-length
    sequences need. With ``max_draft`` > 0 every ring is ``window + max_draft`` rows and the
    draft stages' rings count in the state slot."""
    footprint = cache_footprint(
        model_config, block_size=config.block_size, max_draft=max_draft, dtype=dtype
    )
    if max_draft:
        footprint = replace(
            footprint,
            bytes_per_slot=footprint.bytes_per_slot
            + _draft_ring_bytes(model_config, max_draft, dtype),
        )
    if device.type == "cuda":
        activation = _profile_activation_bytes(model, model_config, config, device, dtype)
        free, total = torch.cuda.mem_get_info(device)
        utilization = config.gpu_memory_utilization
        peak = device_peak_bytes(
            total_bytes=total,
            free_bytes=free,
            free_before_load_bytes=before[0],
            held_before_load_bytes=before[1],
            activation_bytes=activation,
            reserve_bytes=reserve,
            gpu_memory_utilization=utilization,
        )
    else:  # a CPU has no device memory to fill: a fixed share of RAM
        total, peak, utilization = min(CPU_CACHE_BUDGET, int(_available_ram() * 0.25)), 0, 1.0
    capacity = plan_cache_capacity(
        total_memory_bytes=total,
        peak_memory_bytes=peak,
        gpu_memory_utilization=utilization,
        bytes_per_block=footprint.bytes_per_block,
        bytes_per_state_slot=footprint.bytes_per_slot,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
    )
    if config.num_cache_blocks is not None:
        return config.num_cache_blocks + 1, capacity.num_state_slots  # + the reserved block 0
    max_len = config.max_model_len or model_config.max_position_embeddings
    wanted = config.max_num_seqs * -(-max_len // config.block_size) + 1
    return min(capacity.num_blocks, wanted), capacity.num_state_slots


def _draft_ring_bytes(model_config: ModelConfig, max_draft: int, dtype) -> int:
    """Bytes per state slot of the DSpark stages' window rings (``DSparkDraft.allocate``)."""
    ring = model_config.sliding_window + max_draft
    element = torch.empty((), dtype=dtype).element_size()
    return model_config.num_mtp_layers * ring * model_config.head_dim * element


def _available_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * 2**30


@torch.inference_mode()
def _profile_activation_bytes(model, model_config, config: EngineConfig, device, dtype) -> int:
    """Peak memory of one forward over ``max_num_batched_tokens`` tokens, above the weights."""
    tokens = min(
        config.max_num_batched_tokens, PROFILE_TOKENS_CAP, model_config.max_position_embeddings
    )
    blocks = -(-tokens // config.block_size) + 1
    cache = ModelCache(
        model_config, CacheLayout(blocks, 2, config.block_size), dtype=dtype, device=device
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    batch = ForwardBatch(
        input_ids=torch.randint(0, model_config.vocab_size, (tokens,), device=device),
        positions=torch.arange(tokens, device=device),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], device=device),
        block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None],
        state_slots=torch.tensor([1], device=device),
        logits_indices=torch.tensor([tokens - 1], device=device),
    )
    model(batch, cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    torch.cuda.empty_cache()
    return int(peak * 1.1)
