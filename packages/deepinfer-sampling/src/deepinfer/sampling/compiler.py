"""Grammar compilation for structured outputs: one xgrammar compiler and cache per tokenizer.

:class:`GrammarCompilerService` compiles JSON schemas, regexes and EBNF grammars on a background
thread pool. ``submit(spec)`` returns at once with a :class:`PendingGrammar`; the engine polls
it each step (``status()``) and builds the request's matcher once it is ready. A compile that
raises (an invalid schema, regex or grammar) or that is still running after the timeout
(``DEEPINFER_XGRAMMAR_TIMEOUT``, default 20 s) fails that request alone, with the compiler's
message. Threads cannot be cancelled: a timed-out compile keeps its thread until it ends, and
its result is dropped. Compiled grammars are cached by xgrammar (keyed by the grammar source)
and concurrent submissions of the same spec share one compile.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from deepinfer.kernels import envs
from deepinfer.sampling.params import GrammarSpec

PENDING, READY, FAILED = "pending", "ready", "failed"


class GrammarError(RuntimeError):
    """A grammar that failed to compile or timed out; the message says which and why."""


class PendingGrammar:
    """A compile in flight for one request. Poll :meth:`status`; never blocks unless asked."""

    def __init__(self, spec: GrammarSpec, future: Future, timeout_s: float) -> None:
        self.spec = spec
        self._future = future
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s

    def status(self) -> str:
        """``"pending"``, ``"ready"`` or ``"failed"`` (an error, or past the deadline)."""
        if self._future.done():
            return FAILED if self._future.exception() is not None else READY
        return FAILED if time.monotonic() >= self._deadline else PENDING

    @property
    def error(self) -> str | None:
        """Why the compile failed (the compiler's message, or the timeout), else None."""
        if self._future.done():
            exc = self._future.exception()
            return None if exc is None else str(exc)
        if time.monotonic() >= self._deadline:
            return (
                f"{self.spec.kind} grammar did not compile within {self._timeout_s:g} s "
                f"(DEEPINFER_XGRAMMAR_TIMEOUT)"
            )
        return None

    @property
    def grammar(self) -> xgr.CompiledGrammar:
        """The compiled grammar; raises :class:`GrammarError` unless ``status() == "ready"``."""
        state = self.status()
        if state != READY:
            raise GrammarError(self.error or f"grammar is still {state}")
        return self._future.result()

    def wait(self) -> xgr.CompiledGrammar:
        """Block until ready or failed (at most until the deadline); return or raise."""
        remaining = self._deadline - time.monotonic()
        # The outcome (a value, an error or a timeout) is read back through ``self.grammar``.
        with contextlib.suppress(Exception):
            self._future.result(timeout=max(remaining, 0.0))
        return self.grammar


class GrammarCompilerService:
    """One xgrammar ``GrammarCompiler`` (with its cache) and a compile thread pool.

    tokenizer_info: ``xgrammar.TokenizerInfo`` for the model (its ``vocab_size`` is the logits
    width). timeout_s: per-request compile deadline; None reads ``DEEPINFER_XGRAMMAR_TIMEOUT``.
    json_any_whitespace: let JSON contain free whitespace (models that pretty-print); the
    whitespace run length is capped by ``max_json_whitespace``.
    """

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        timeout_s: float | None = None,
        max_threads: int = 4,
        cache_limit_bytes: int = -1,
        json_any_whitespace: bool = True,
        max_json_whitespace: int | None = 8,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.timeout_s = float(
            envs.get("DEEPINFER_XGRAMMAR_TIMEOUT") if timeout_s is None else timeout_s
        )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: expected a positive number of seconds")
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes
        )
        self._json_options = {"any_whitespace": json_any_whitespace, "strict_mode": True}
        if json_any_whitespace and max_json_whitespace is not None:
            self._json_options["max_whitespace_cnt"] = max_json_whitespace
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="xgrammar")
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], Future] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None, **kwargs: Any):
        """Build from a Hugging Face tokenizer; ``vocab_size`` = the model's logits width."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return cls(info, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(spec.source, **self._json_options)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return self._compiler.compile_grammar(spec.source)
        except Exception as e:  # report the compiler's own message for this request only
            raise GrammarError(f"invalid {spec.kind} grammar: {e}".strip()) from e
        raise GrammarError(f"unknown grammar kind {spec.kind!r}: expected json, regex or ebnf")

    def submit(self, spec: GrammarSpec) -> PendingGrammar:
        """Start compiling ``spec`` (or join a compile of the same spec); returns at once."""
        key = spec.cache_key
        with self._lock:
            future = self._in_flight.get(key)
            is_new = future is None
            if is_new:
                future = self._pool.submit(self._compile, spec)
                self._in_flight[key] = future
        if is_new:
            # Outside the lock: a future that is already done runs the callback right here.
            future.add_done_callback(lambda done, key=key: self._forget(key, done))
        return PendingGrammar(spec, future, self.timeout_s)

    def _forget(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            if self._in_flight.get(key) is future:
                del self._in_flight[key]

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Blocking compile with the same timeout and errors (for use outside an engine)."""
        return self.submit(spec).wait()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_SERVICES: weakref.WeakKeyDictionary[Any, dict[int | None, GrammarCompilerService]] = (
    weakref.WeakKeyDictionary()
)
_SERVICES_LOCK = threading.Lock()


def compiler_for_tokenizer(
    tokenizer: Any, vocab_size: int | None = None, **kwargs: Any
) -> GrammarCompilerService:
    """The process-wide service for ``tokenizer`` (one per tokenizer and vocab size).

    ``kwargs`` (GrammarCompilerService options) apply only when the service is first made.
    """
    with _SERVICES_LOCK:
        per_tokenizer = _SERVICES.setdefault(tokenizer, {})
        service = per_tokenizer.get(vocab_size)
        if service is None:
            service = GrammarCompilerService.from_tokenizer(tokenizer, vocab_size, **kwargs)
            per_tokenizer[vocab_size] = service
        return service


__all__ = [
    "FAILED",
    "PENDING",
    "READY",
    "GrammarCompilerService",
    "GrammarError",
    "PendingGrammar",
    "compiler_for_tokenizer",
]
