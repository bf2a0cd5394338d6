"""``SamplingParams`` and ``StructuredOutputs``: what a request asks of the sampler.

Both are frozen dataclasses validated at construction: a bad value raises ``ValueError`` naming
the field, the value and what was expected. Structured outputs can be given DeepInfer's way
(``so_args={"schema_type": "json" | "regex" | "ebnf", "schema": ..., "trigger_token_ids": [...],
"bound_token_id": ...}``) or as ``structured_outputs=StructuredOutputs(json=..., regex=...,
grammar=..., choice=[...])``; both resolve to one :class:`GrammarSpec` (``params.grammar_spec``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.sampling.rng import random_seeds

MAX_LOGPROBS = 1000
SEED_MASK = (1 << 63) - 1
# Bits of ``SamplingParams.row_flags``: the sampler ORs / ANDs them over a batch in one pass.
ROW_PLAIN_GREEDY = 1  # greedy with no processing and no logprobs
ROW_GREEDY = 2
ROW_LOGPROBS = 4
ROW_PROCESSED = 8  # penalties, token bans or logit bias
ROW_UNSEEDED = 16
_SCHEMA_TYPES = ("json", "regex", "ebnf")


_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/-")


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (only metacharacters are escaped, which both
    Python's ``re`` and xgrammar's ECMAScript-style parser accept)."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _fail(name: str, value: Any, expected: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r}: expected {expected}")


def _check_number(name: str, value: Any, lo: float, hi: float, *, lo_open=False, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        _fail(name, value, "a number")
    too_low = value <= lo if lo_open else value < lo
    too_high = value >= hi if hi_open else value > hi
    if too_low or too_high:
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        _fail(name, value, f"a number in {left}{lo}, {hi}{right}")


def _check_int(name: str, value: Any, lo: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        _fail(name, value, f"an integer >= {lo}" + (" or None" if optional else ""))


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        _fail(name, value, "a list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            _fail(name, value, "a list of non-negative integer token ids")
    return tuple(value)


@dataclass(frozen=True)
class GrammarSpec:
    """A resolved structured-output request: the grammar kind, its source and trigger tokens.

    kind: ``"json"`` (a JSON schema as a string), ``"regex"`` or ``"ebnf"`` (xgrammar EBNF with a
    ``root`` rule). ``source`` is the exact text handed to the compiler and, with ``kind``, the
    compile-cache key. ``trigger_token_ids`` / ``bound_token_id`` follow DeepInfer: generation is
    free until the trigger sequence appears; a bound token forces the rest of the trigger.
    """

    kind: str
    source: str
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.source)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of ``json`` (schema dict or string), ``regex``, ``grammar`` (EBNF), ``choice``."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputs: expected exactly one of json, regex, grammar, choice; "
                f"got {given or 'none'}"
            )
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError(
                    f"StructuredOutputs.choice={choice!r}: expected a non-empty list of strings"
                )
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputs.{name}={value!r}: expected a non-empty string")

    def to_spec(self) -> GrammarSpec:
        if self.json is not None:
            source = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return GrammarSpec("json", source)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.grammar is not None:
            return GrammarSpec("ebnf", self.grammar)
        return GrammarSpec("regex", "|".join(f"({_regex_literal(c)})" for c in self.choice))


def _spec_from_so_args(so_args: Any) -> GrammarSpec:
    if not isinstance(so_args, Mapping):
        _fail("so_args", so_args, "a dict with schema_type and schema")
    unknown = set(so_args) - {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}
    if unknown:
        _fail("so_args", so_args, f"only schema_type, schema, trigger_token_ids, bound_token_id "
              f"(unknown keys {sorted(unknown)})")  # fmt: skip
    kind = so_args.get("schema_type")
    if kind not in _SCHEMA_TYPES:
        _fail("so_args.schema_type", kind, f"one of {', '.join(_SCHEMA_TYPES)}")
    schema = so_args.get("schema")
    if kind == "json" and isinstance(schema, Mapping):
        schema = json.dumps(schema)
    if not isinstance(schema, str) or not schema:
        _fail("so_args.schema", schema, "a non-empty string (or a dict for json)")
    trigger = _token_ids("so_args.trigger_token_ids", so_args.get("trigger_token_ids") or [])
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            _fail("so_args.bound_token_id", bound, "a non-negative token id")
        if not trigger:
            _fail("so_args.bound_token_id", bound, "to be given only with trigger_token_ids")
    return GrammarSpec(kind, schema, trigger, bound)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    temperature: 0 means greedy (argmax, lowest index on ties); else > 0.
    top_p in (0, 1]; top_k: -1 or 0 = off, else >= 1; min_p in [0, 1] (keep tokens with
    p >= min_p * p_max). max_tokens >= 1; min_tokens <= max_tokens (EOS and stop tokens masked
    until reached). stop: strings (matched by the engine's detokenizer); stop_token_ids.
    seq_seed (alias ``seed``): the per-request RNG seed; None = random, resolved at admission
    by :meth:`with_resolved_seed`. n: completions per prompt. presence/frequency_penalty in
    [-2, 2]; repetition_penalty > 0 (1 = off). logit_bias: {token id: bias in [-100, 100]}.
    logprobs: number of top alternatives to return per token (0 = only the sampled token's
    logprob, None = none). prompt_logprobs likewise for prompt tokens. first_n_token_no_eos:
    EOS is masked for the first n generated tokens. eos_token_id: filled by the engine from the
    tokenizer (masked by min_tokens / first_n_token_no_eos unless ``ignore_eos``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seq_seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    first_n_token_no_eos: int = 0
    so_args: Mapping[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    eos_token_id: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self._resolve_seed_alias()
        _check_number("temperature", self.temperature, 0.0, 1e6)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            _fail("top_k", self.top_k, "-1 or 0 (off) or an integer >= 1")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        self._check_stop()
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "a bool")
        _check_int("n", self.n, 1)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 1e6, lo_open=True)
        self._check_logit_bias()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                _fail(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
        _check_int("first_n_token_no_eos", self.first_n_token_no_eos, 0)
        _check_int("eos_token_id", self.eos_token_id, 0, optional=True)
        self._check_structured()
        self._cache_row_values()

    def _cache_row_values(self) -> None:
        """Per-step host preparation reads these instead of re-deriving them for every row."""
        cache = object.__setattr__
        cache(self, "row_floats", (self.temperature or 1.0, self.top_p, self.min_p))
        cache(self, "has_penalty", self.presence_penalty != 0 or self.frequency_penalty != 0
              or self.repetition_penalty != 1)  # fmt: skip
        cache(self, "has_bans", self.min_tokens > 0 or self.first_n_token_no_eos > 0)
        plain = not (self.has_penalty or self.has_bans or self.logit_bias)
        cache(self, "is_plain_greedy", plain and self.temperature == 0.0 and self.logprobs is None)
        greedy = self.temperature == 0.0
        flags = (
            ROW_PLAIN_GREEDY * self.is_plain_greedy
            | ROW_GREEDY * greedy
            | ROW_LOGPROBS * (self.logprobs is not None)
            | ROW_PROCESSED * (not plain)
            | ROW_UNSEEDED * (self.seq_seed is None)
        )
        cache(self, "row_flags", flags)
        # the row's record in the sampler's host preparation (see sampling.rows)
        seed = self.seq_seed if self.seq_seed is not None else 0
        cache(self, "row_bytes", struct.pack("<4f4q", *self.row_floats, 0.0, self.top_k, seed,
                                             greedy, flags))  # fmt: skip

    def _resolve_seed_alias(self) -> None:
        if self.seed is not None and self.seq_seed is not None and self.seed != self.seq_seed:
            _fail("seed", self.seed, f"the same value as seq_seed ({self.seq_seed}) or unset")
        seed = self.seq_seed if self.seq_seed is not None else self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            _fail("seq_seed", seed, "an integer or None")
        # Seeds are used as 63-bit non-negative integers (uint64 seeds are masked like DeepInfer).
        seed = None if seed is None else seed & SEED_MASK
        object.__setattr__(self, "seq_seed", seed)
        object.__setattr__(self, "seed", seed)

    def _check_stop(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", self.stop, "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(
            self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)
        )

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, Mapping):
            _fail("logit_bias", self.logit_bias, "a dict {token id: bias}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                _fail("logit_bias", self.logit_bias, f"non-negative int keys (got key {token!r})")
            _check_number(f"logit_bias[{token}]", bias, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))

    def _check_structured(self) -> None:
        if self.so_args is not None and self.structured_outputs is not None:
            _fail("so_args", self.so_args, "unset when structured_outputs is given")
        if self.so_args is not None:
            _spec_from_so_args(self.so_args)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            _fail("structured_outputs", self.structured_outputs, "a StructuredOutputs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The structured-output request in one form, or None."""
        if self.so_args is not None:
            return _spec_from_so_args(self.so_args)
        if self.structured_outputs is not None:
            return self.structured_outputs.to_spec()
        return None

    def with_resolved_seed(self, seed: int | None = None) -> SamplingParams:
        """A copy whose ``seq_seed`` is concrete: ``seed`` if given, else a fresh random one.

        Call once at request admission; a request that already has a seed is returned as is.
        """
        if self.seq_seed is not None:
            return self
        from dataclasses import replace

        value = seed if seed is not None else random_seeds(1)[0]
        return replace(self, seq_seed=value, seed=None)


def resolve_seeds(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """:meth:`SamplingParams.with_resolved_seed` for each request (one random draw per unset)."""
    fresh = iter(random_seeds(sum(p.seq_seed is None for p in params)))
    return [p.with_resolved_seed(next(fresh)) if p.seq_seed is None else p for p in params]


__all__ = ["GrammarSpec", "MAX_LOGPROBS", "SamplingParams", "StructuredOutputs", "resolve_seeds"]
