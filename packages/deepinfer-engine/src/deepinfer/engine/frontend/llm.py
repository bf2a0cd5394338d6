"""The offline API: ``LLM(...).generate / chat / stream``.

``LLM`` resolves its arguments once into an :class:`EngineConfig`, asks :meth:`LLM._load_executor`
for the executor, tokenizer and cache capacity, and drives an :class:`EngineCore`. Every
request of a call is validated before any work starts; a request that fails while running
finishes alone with ``finish_reason="error"`` and a message, the others complete.
"""

from __future__ import annotations

import inspect
import itertools
import textwrap
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from deepinfer.engine.config import (
    REMOVED_PARAMETERS,
    EngineConfig,
    LoadedModel,
    resolve_max_model_len,
    scheduler_config,
)
from deepinfer.engine.core.config import log_capacity
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.frontend.inputs import normalize_params, normalize_prompts, seed_stream
from deepinfer.engine.frontend.multimodal import ImageRequests, split_prompt_dicts
from deepinfer.engine.frontend.output_processor import OutputProcessor
from deepinfer.engine.frontend.outputs import RequestOutput
from deepinfer.engine.frontend.progress import ThroughputBar
from deepinfer.engine.frontend.validation import (
    InvalidRequestError,
    engine_refusal,
    validate_batch,
)
from deepinfer.engine.logs import set_log_level
from deepinfer.sampling import SamplingParams

_PARAMETERS = {f.name for f in EngineConfig.parameters()}


class LLM:
    """An offline engine for one model.

    Args: (written from :class:`~deepinfer.engine.config.EngineConfig`'s declaration below)
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in _PARAMETERS]
        for name in unknown:
            if name in REMOVED_PARAMETERS:
                raise TypeError(f"LLM(): {name!r} was replaced by {REMOVED_PARAMETERS[name]}")
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
        set_log_level()
        config = EngineConfig(model=model, **kwargs)
        loaded = self._load_executor(config)
        self.config = resolve_max_model_len(config, loaded)
        self.scheduler_config = scheduler_config(self.config, loaded)
        log_capacity(self.scheduler_config)
        self._tokenizer = loaded.tokenizer
        self._vocab_size = loaded.vocab_size
        self._eos_token_ids = loaded.eos_token_ids
        sc = self.scheduler_config
        self._images = ImageRequests(loaded.vision, sc.max_model_len, sc.max_num_batched_tokens)
        self._distributed = config.data_parallel_size > 1
        if self._distributed:
            from deepinfer.engine.distributed.start import make_core

            self._core = make_core(self.config, self.scheduler_config, loaded)
        else:
            scheduler = Scheduler(self.scheduler_config, tokenizer=loaded.tokenizer)
            self._core = EngineCore(
                scheduler, loaded.executor, async_scheduling=self.config.async_scheduling
            )
        self._outputs = OutputProcessor()
        self._seeds = seed_stream(self.config.seed)
        self._request_counter = itertools.count()

    def _load_executor(self, config: EngineConfig) -> LoadedModel:
        """Load weights and tokenizer, profile, allocate the cache; return what the engine needs.

        The model runner implements this; tests override it with a fake executor. With
        ``data_parallel_size`` > 1 the ranks load their own models (``engine.distributed``).
        """
        if config.data_parallel_size > 1:
            from deepinfer.engine.distributed.start import start_ranks

            return start_ranks(config)
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
        multi_modal_data: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in input order.

        Give ``prompts`` (text), ``prompt_token_ids``, or both (then the ids are used and the
        text is only reported). Images (V4.1): a prompt may be a dict ``{"prompt" or
        "prompt_token_ids": ..., "multi_modal_data": {"image": image or list}}``, or
        ``multi_modal_data`` gives one such dict per prompt; each image needs one placeholder
        token (``<｜deepseek_image｜>``) in the prompt, which becomes the image's span. An
        image is a ``PIL.Image``, encoded bytes, a path, a ``file://`` or a ``data:`` URL; a
        request whose images do not fit finishes alone with ``finish_reason="error"``. ``sampling_params``: one for all, one per prompt, or None for
        the defaults. Raises :class:`InvalidRequestError` (naming the request index) before
        any work if an input is invalid. Under ``torchrun`` only rank 0 returns the outputs;
        the other ranks serve its call and return ``[]``.
        """
        if self._serve_rank0():
            return []
        request_ids = self._submit(
            prompts, sampling_params, prompt_token_ids, multi_modal_data=multi_modal_data
        )
        return self._run_to_completion(request_ids, use_tqdm)

    def stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        multi_modal_data: Any = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate` (images included), but yield per-step deltas as tokens arrive.

        Each item is a ``RequestOutput`` whose ``outputs`` hold the samples that changed, with
        only their new text and tokens; the last item of a request has ``finished=True``.
        Text that could still turn out to be the start of a stop string is held back.
        Inputs are validated (and the requests queued) on the call, before iteration; closing
        the iterator early aborts the requests still running.
        """
        if self._serve_rank0():
            return iter(())
        request_ids = self._submit(
            prompts, sampling_params, prompt_token_ids, multi_modal_data=multi_modal_data
        )
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

        ``conversations``: one list of OpenAI-style messages, or a list of them. A message's
        ``content`` may be a list of parts: ``{"type": "text", "text": ...}``, ``{"type":
        "image_url", "image_url": {"url": "data:image/...;base64,..." | "file://..."}}`` or
        ``{"type": "image", "image": PIL.Image}`` (V4.1; each image takes its place in the text).
        """
        if self._serve_rank0():
            return []
        from deepinfer.engine.frontend.chat import encode_conversations, parse_outputs

        texts, token_ids, images = encode_conversations(
            self._tokenizer, conversations, thinking, reasoning_effort, tools
        )
        request_ids = self._submit(
            texts, sampling_params, token_ids, skip_special_tokens=False, multi_modal_data=images
        )
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
        if self._serve_rank0():
            return iter(())
        from deepinfer.engine.frontend.chat import ChatStreamParser, encode_conversations

        texts, token_ids, images = encode_conversations(
            self._tokenizer, conversations, thinking, reasoning_effort, tools
        )
        request_ids = self._submit(
            texts, sampling_params, token_ids, skip_special_tokens=False, multi_modal_data=images
        )
        return RequestStream(self, request_ids, annotate=ChatStreamParser(thinking).annotate)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Finish these requests with ``finish_reason="abort"`` (they report at the next step)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._core.abort(ids)

    def close(self) -> None:
        """Stop the worker processes of ``data_parallel_size`` > 1 (also done when the ``LLM``
        is collected or the program exits); nothing to do for one process."""
        if self._distributed:
            self._core.close()

    # ------------------------------------------------------------------ internals
    def _serve_rank0(self) -> bool:
        """On a torchrun rank other than 0: serve rank 0's matching call, then True."""
        if not getattr(self._core, "is_follower", False):
            return False
        self._core.serve_call()
        return True

    def _end_call(self) -> None:
        """Tell ranks that follow the calls (torchrun) that this one is over."""
        if self._distributed:
            self._core.end_call()

    def _submit(
        self,
        prompts: Any,
        sampling_params: Any,
        prompt_token_ids: Any,
        *,
        skip_special_tokens: bool = True,
        multi_modal_data: Any = None,
    ) -> list[str]:
        prompts, prompt_token_ids, images = split_prompt_dicts(
            prompts, prompt_token_ids, multi_modal_data
        )
        texts, token_ids = normalize_prompts(prompts, prompt_token_ids, self._tokenizer)
        params = normalize_params(sampling_params, len(token_ids))
        # a request whose images do not fit, or that the engine's settings cannot serve, fails
        # alone (rejected[i] says why)
        token_ids, image_inputs, rejected = self._images.prepare_all(token_ids, images)
        validate_batch(
            token_ids,
            params,
            vocab_size=self._vocab_size,
            max_model_len=self.scheduler_config.max_model_len,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            has_tokenizer=self._tokenizer is not None,
        )
        yoco = self.config.yoco_prefill_truncation_mode
        for index, p in enumerate(params):
            if rejected[index] is None:
                rejected[index] = engine_refusal(index, p, yoco_truncation=yoco)
        request_ids = []
        eos = min(self._eos_token_ids) if self._eos_token_ids else None
        for index, (text, ids, p) in enumerate(zip(texts, token_ids, params)):
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
            request.images = image_inputs[index]
            if rejected[index] is None:
                self._core.add_request(request)
            else:
                self._core.scheduler.reject_request(request, rejected[index])
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
                for request_id in self._outputs.apply(self._core.step()):
                    if request_id in pending and self._outputs.is_finished(request_id):
                        pending.discard(request_id)
                        results[request_id] = output = self._outputs.pop_output(request_id)
                        bar.finished(output)
        finally:
            bar.close()
            self._abandon(pending)
            self._end_call()
        return [results[request_id] for request_id in request_ids]

    def _abandon(self, request_ids: set[str]) -> None:
        """Abort requests a caller stopped waiting for (an exception, a closed stream)."""
        if request_ids:
            self._core.abort(request_ids)
            for request_id in request_ids:
                self._outputs.forget(request_id)


def _document_parameters(cls: type) -> None:
    """``cls.__init__``'s signature and the Args of ``cls``'s docstring, from the declaration."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    lines = [cls.__doc__.split("    Args:")[0].rstrip(), "", "    Args:"]
    for f in EngineConfig.parameters():
        kind = inspect.Parameter.KEYWORD_ONLY
        if f.name == "model":
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
        text = f"{f.name}: {f.metadata['help']}"
        lines += textwrap.wrap(text, 96, initial_indent=" " * 8, subsequent_indent=" " * 12)
    cls.__init__.__signature__ = inspect.Signature(params)
    cls.__doc__ = "\n".join(lines) + "\n"


_document_parameters(LLM)

__all__ = ["LLM", "InvalidRequestError", "RequestStream", "SamplingParams"]


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
        self._ended = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while not self._ready:
            if not self._pending:
                self._end()
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
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._llm._end_call()

    def __del__(self) -> None:
        if getattr(self, "_pending", None):
            self.close()
