"""The offline API: ``LLM(...).generate / chat / stream``.

``LLM`` resolves its arguments once into an :class:`EngineConfig`, asks :meth:`LLM._load_executor`
for the executor, tokenizer and cache capacity, and drives an :class:`EngineCore`. Every
request of a call is validated before any work starts; a request that fails while running
finishes alone with ``finish_reason="error"`` and a message, the others complete.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from deepinfer.engine.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MODEL,
    EngineConfig,
    LoadedModel,
    log_capacity,
    resolve_max_model_len,
    scheduler_config,
)
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.frontend.inputs import normalize_params, normalize_prompts, seed_stream
from deepinfer.engine.frontend.output_processor import OutputProcessor
from deepinfer.engine.frontend.outputs import RequestOutput
from deepinfer.engine.frontend.progress import ThroughputBar
from deepinfer.engine.frontend.validation import InvalidRequestError, validate_batch
from deepinfer.kernels import envs
from deepinfer.sampling import SamplingParams


def resolve_model(model: str | None) -> str:
    """``model``, else ``DEEPINFER_HF_MODEL_DIR``, else the default hub id."""
    if model is not None:
        return str(model)
    return envs.get("DEEPINFER_HF_MODEL_DIR") or DEFAULT_MODEL


class LLM:
    """An offline engine for one model.

    Args:
        model: a hub id or a local checkpoint directory; None means ``DEEPINFER_HF_MODEL_DIR``
            if set, else ``deepseek-ai/DeepSeek-V4.1-Flash-1017``.
        accelerator: ``"auto" | "nvidia" | "ascend" | "cpu"``.
        dtype: activation dtype, ``"bfloat16" | "float16" | "float32"``.
        max_model_len: most tokens (prompt + output) per sequence; None = the model's limit
            capped by the KV-cache capacity.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget per step (None = 8192, or ``max_model_len`` when
            chunked prefill is off).
        gpu_memory_utilization: fraction of device memory for weights, activations and cache.
        load_format: ``"auto"`` (the checkpoint's weights) or ``"dummy"`` (random weights).
        quant_simulation: force the FP8/FP4 activation simulation on or off (None = follow
            the checkpoint).
        seed: seeds the engine's random state and the per-request seeds of requests that set
            none (so a rerun of the same script reproduces them).
        block_size: tokens per KV-cache block.
        enable_chunked_prefill: split long prompts across steps.
        num_cache_blocks: use this many KV-cache blocks instead of the number that fits in
            memory (reproducible capacity; small values force preemption in tests).
        speculative_tokens: DSpark drafts per decode step (None: ``DEEPINFER_USE_NEXTN_DECODE``,
            default 5, capped at the checkpoint's ``dspark_block_size``; 0: no speculation).
            Only checkpoints with DSpark draft stages speculate.
        spec_acceptance: how sampled requests verify drafts: ``"auto"`` (seed-exact when the
            request sets a seed, so its tokens equal a run without speculation; rejection
            sampling otherwise, exact in distribution), ``"seed_exact"`` or ``"rejection"``.
            Greedy requests always take the argmax prefix.
        spec_varlen: confidence-scheduled verification (each request verifies the drafts
            worth their cost); None: ``DEEPINFER_ENABLE_MTP_VARLEN``.
        spec_cost_curve: the ``deepinfer.spec.StepCostCurve`` that planning uses; None
            measures one at start-up.
        return_draft_confidences: report each verified draft's confidence in
            ``RequestOutput.metrics.draft_confidences``.
        enforce_eager: run every step eagerly. By default, on a CUDA device without
            speculation, decode-only steps (one token per sequence) replay CUDA graphs
            captured on first use per (batch size, context bucket); outputs are identical.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        accelerator: str = "auto",
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        load_format: str = "auto",
        quant_simulation: bool | None = None,
        seed: int = 0,
        block_size: int = 128,
        enable_chunked_prefill: bool = True,
        num_cache_blocks: int | None = None,
        speculative_tokens: int | None = None,
        spec_acceptance: str = "auto",
        spec_varlen: bool | None = None,
        spec_cost_curve: Any = None,
        return_draft_confidences: bool = False,
        enforce_eager: bool = False,
    ) -> None:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not enable_chunked_prefill and max_model_len is not None:
                max_num_batched_tokens = max(max_model_len, max_num_batched_tokens)
        config = EngineConfig(
            model=resolve_model(model),
            accelerator=accelerator,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            load_format=load_format,
            quant_simulation=quant_simulation,
            seed=seed,
            block_size=block_size,
            enable_chunked_prefill=enable_chunked_prefill,
            num_cache_blocks=num_cache_blocks,
            speculative_tokens=speculative_tokens,
            spec_acceptance=spec_acceptance,
            spec_varlen=spec_varlen,
            spec_cost_curve=spec_cost_curve,
            return_draft_confidences=return_draft_confidences,
            enforce_eager=enforce_eager,
        )
        loaded = self._load_executor(config)
        self.config = resolve_max_model_len(config, loaded)
        self.scheduler_config = scheduler_config(self.config, loaded)
        log_capacity(self.scheduler_config)
        self._tokenizer = loaded.tokenizer
        self._vocab_size = loaded.vocab_size
        self._eos_token_ids = loaded.eos_token_ids
        scheduler = Scheduler(self.scheduler_config, tokenizer=loaded.tokenizer)
        self._core = EngineCore(scheduler, loaded.executor)
        self._outputs = OutputProcessor()
        self._seeds = seed_stream(seed)
        self._request_counter = itertools.count()

    def _load_executor(self, config: EngineConfig) -> LoadedModel:
        """Load weights and tokenizer, profile, allocate the cache; return what the engine needs.

        The model runner implements this; tests override it with a fake executor.
        """
        from deepinfer.engine.runner.loading import load_executor

        return load_executor(config)

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in input order.

        Give ``prompts`` (text), ``prompt_token_ids``, or both (then the ids are used and the
        text is only reported). ``sampling_params``: one for all, one per prompt, or None for
        the defaults. Raises :class:`InvalidRequestError` (naming the request index) before
        any work if an input is invalid.
        """
        request_ids = self._submit(prompts, sampling_params, prompt_token_ids)
        return self._run_to_completion(request_ids, use_tqdm)

    def stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yield per-step deltas as tokens arrive.

        Each item is a ``RequestOutput`` whose ``outputs`` hold the samples that changed, with
        only their new text and tokens; the last item of a request has ``finished=True``.
        Text that could still turn out to be the start of a stop string is held back.
        Inputs are validated (and the requests queued) on the call, before iteration; closing
        the iterator early aborts the requests still running.
        """
        request_ids = self._submit(prompts, sampling_params, prompt_token_ids)
        return RequestStream(self, request_ids)

    def chat(
        self,
        conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        thinking: bool = False,
        reasoning_effort: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Chat completions with the V4 encoding; each sample's text is parsed into
        ``reasoning_content``, ``content`` and ``tool_calls``.

        ``conversations``: one list of OpenAI-style messages, or a list of them.
        """
        from deepinfer.engine.frontend.chat import encode_conversations, parse_outputs

        texts, token_ids = encode_conversations(
            self._tokenizer, conversations, thinking, reasoning_effort, tools
        )
        request_ids = self._submit(texts, sampling_params, token_ids, skip_special_tokens=False)
        outputs = self._run_to_completion(request_ids, use_tqdm)
        parse_outputs(outputs, thinking)
        return outputs

    def stream_chat(
        self,
        conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        thinking: bool = False,
        reasoning_effort: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`chat`, streamed as :meth:`stream` does; each delta's samples carry the
        ``reasoning_content`` / ``content`` / ``tool_calls`` their new text completed."""
        from deepinfer.engine.frontend.chat import ChatStreamParser, encode_conversations

        texts, token_ids = encode_conversations(
            self._tokenizer, conversations, thinking, reasoning_effort, tools
        )
        request_ids = self._submit(texts, sampling_params, token_ids, skip_special_tokens=False)
        return RequestStream(self, request_ids, annotate=ChatStreamParser(thinking).annotate)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Finish these requests with ``finish_reason="abort"`` (they report at the next step)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._core.abort(ids)

    # ------------------------------------------------------------------ internals
    def _submit(
        self,
        prompts: Any,
        sampling_params: Any,
        prompt_token_ids: Any,
        *,
        skip_special_tokens: bool = True,
    ) -> list[str]:
        texts, token_ids = normalize_prompts(prompts, prompt_token_ids, self._tokenizer)
        params = normalize_params(sampling_params, len(token_ids))
        validate_batch(
            token_ids,
            params,
            vocab_size=self._vocab_size,
            max_model_len=self.scheduler_config.max_model_len,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            has_tokenizer=self._tokenizer is not None,
        )
        request_ids = []
        eos = min(self._eos_token_ids) if self._eos_token_ids else None
        for text, ids, p in zip(texts, token_ids, params):
            has_user_seed = p.seq_seed is not None
            if p.seq_seed is None:
                p = replace(p, seq_seed=next(self._seeds), seed=None)
            if p.eos_token_id is None and eos is not None:
                p = replace(p, eos_token_id=eos)
            request_id = str(next(self._request_counter))
            arrival = time.monotonic()
            self._outputs.add(request_id, text, ids, p, arrival)
            request = Request(
                request_id,
                list(ids),
                p,
                seed=p.seq_seed,
                eos_token_ids=self._eos_token_ids,
                arrival_time=arrival,
                skip_special_tokens=skip_special_tokens,
                has_user_seed=has_user_seed,
            )
            self._core.add_request(request)
            request_ids.append(request_id)
        return request_ids

    def _step(self) -> list[RequestOutput]:
        return self._outputs.process(self._core.step())

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until these requests finish; their outputs in the given order."""
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = ThroughputBar(len(request_ids), enabled=use_tqdm)
        try:
            while pending:
                for delta in self._step():
                    if delta.finished and delta.request_id in pending:
                        pending.discard(delta.request_id)
                        results[delta.request_id] = output = self._outputs.pop_output(
                            delta.request_id
                        )
                        bar.finished(output)
        finally:
            bar.close()
            self._abandon(pending)
        return [results[request_id] for request_id in request_ids]

    def _abandon(self, request_ids: set[str]) -> None:
        """Abort requests a caller stopped waiting for (an exception, a closed stream)."""
        if request_ids:
            self._core.abort(request_ids)
            for request_id in request_ids:
                self._outputs.forget(request_id)


__all__ = ["LLM", "InvalidRequestError", "RequestStream", "SamplingParams", "resolve_model"]


class RequestStream:
    """Iterator over the streaming deltas of some requests of an :class:`LLM`.

    Closing it (or dropping it) before the end aborts the requests still running.
    """

    def __init__(
        self,
        llm: LLM,
        request_ids: list[str],
        annotate: Callable[[RequestOutput], RequestOutput] | None = None,
    ) -> None:
        self._llm = llm
        self._pending = set(request_ids)
        self._ready: deque[RequestOutput] = deque()
        self._annotate = annotate

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while not self._ready:
            if not self._pending:
                raise StopIteration
            self._collect(self._llm._step())
        return self._ready.popleft()

    def _collect(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            if delta.request_id not in self._pending:
                continue
            if delta.finished:
                self._pending.discard(delta.request_id)
                self._llm._outputs.pop_output(delta.request_id)
            self._ready.append(self._annotate(delta) if self._annotate else delta)

    def close(self) -> None:
        """Abort the requests that have not finished."""
        pending, self._pending = self._pending, set()
        self._llm._abandon(pending)

    def __del__(self) -> None:
        if getattr(self, "_pending", None):
            self.close()
