"""Test helpers shared by the sampler's tests, example and benchmark (no downloads).

* :func:`byte_level_tokenizer` trains a small byte-level BPE in memory and wraps it as a
  ``transformers.PreTrainedTokenizerFast`` (what ``xgrammar.TokenizerInfo.from_huggingface``
  takes). Needs the ``tokenizers`` and ``transformers`` packages (test dependencies).
* :func:`check_json_schema` is a small JSON-schema validator for the keywords the tests use, so
  the tests need no ``jsonschema`` package.
"""

from __future__ import annotations

import functools
import re
from typing import Any

EOS_TOKEN = "<eos>"

_CORPUS = [
    '{"name": "Alice", "age": 30, "email": "alice@example.com", "tags": ["a", "b"]}',
    '{"id": 17, "items": [{"sku": "X-1", "qty": 2, "price": 9.5}], "paid": true, "note": null}',
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}:;,.!?'\"_",
    "select name, count(*) from users where age >= 21 group by name order by name;",
    "2026-11-30T04:42:09Z user@host.org https://example.com/path?q=1&r=2 #tag @who",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ true false null yes no",
]


@functools.cache
def byte_level_tokenizer(vocab_size: int = 512, corpus: tuple[str, ...] | None = None):
    """A trained byte-level BPE tokenizer with ``<eos>`` (id 0); cached per arguments."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = list(corpus) if corpus is not None else _CORPUS * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        path = schema["$ref"].removeprefix("#/").split("/")
        node = root
        for part in path:
            node = node[part]
        schema = node
    return schema


_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _check_type(value: Any, expected: str | list) -> bool:
    if isinstance(expected, list):
        return any(_check_type(value, t) for t in expected)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[expected])


def _check_object(value: dict, schema: dict, root: dict, path: str) -> list[str]:
    errors = []
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            errors.append(f"{path}: missing required {name!r}")
    for name, item in value.items():
        if name in props:
            errors += _check(item, props[name], root, f"{path}.{name}")
        elif schema.get("additionalProperties", True) is False:
            errors.append(f"{path}: unexpected property {name!r}")
    return errors


def _check_array(value: list, schema: dict, root: dict, path: str) -> list[str]:
    errors = []
    if len(value) < schema.get("minItems", 0):
        errors.append(f"{path}: {len(value)} items < minItems")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{path}: {len(value)} items > maxItems")
    prefix = schema.get("prefixItems", [])
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else schema.get("items")
        if sub is not None:
            errors += _check(item, sub, root, f"{path}[{i}]")
    return errors


def _check_scalar(value: Any, schema: dict, path: str) -> list[str]:
    errors = []
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than minLength")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than maxLength")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum")
    return errors


def _check(value: Any, schema: dict, root: dict, path: str) -> list[str]:
    schema = _resolve(schema, root)
    if "anyOf" in schema:
        if all(_check(value, s, root, path) for s in schema["anyOf"]):
            return [f"{path}: matches no anyOf branch"]
        return []
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in enum"]
    if "const" in schema and value != schema["const"]:
        return [f"{path}: {value!r} != const"]
    if "type" in schema and not _check_type(value, schema["type"]):
        return [f"{path}: {value!r} is not of type {schema['type']}"]
    if isinstance(value, dict):
        return _check_object(value, schema, root, path)
    if isinstance(value, list):
        return _check_array(value, schema, root, path)
    return _check_scalar(value, schema, path)


def check_json_schema(value: Any, schema: dict) -> list[str]:
    """Errors of ``value`` against ``schema`` (empty when valid). Supports type, properties,
    required, additionalProperties, items, prefixItems, min/maxItems, enum, const, pattern,
    min/maxLength, minimum/maximum, anyOf and local ``$ref``."""
    return _check(value, schema, schema, "$")


__all__ = ["EOS_TOKEN", "byte_level_tokenizer", "check_json_schema"]
