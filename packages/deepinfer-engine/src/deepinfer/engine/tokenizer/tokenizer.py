"""A checkpoint's tokenizer: ``tokenizer.json`` + ``tokenizer_config.json`` via ``tokenizers``.

No ``transformers`` at runtime. ``tokenizer_config.json`` contributes the BOS / EOS / PAD
spellings (plain strings or serialised ``AddedToken`` dicts) and ``add_bos_token``; everything
else in it (chat template, class name) is ignored: the V4 chat format is rendered in Python.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from deepinfer.engine.tokenizer.chat_encoding import encode_messages
from deepinfer.engine.tokenizer.special_tokens import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SpecialTokenIds,
    resolve_special_token_ids,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@cache
def byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it stands for (the inverse of GPT-2's
    byte -> character table, which ``tokenizers``' ``ByteLevel`` uses)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


@dataclass(frozen=True)
class TokenizerConfig:
    """What we use of ``tokenizer_config.json``."""

    bos_token: str = BOS_TOKEN
    eos_token: str = EOS_TOKEN
    pad_token: str | None = PAD_TOKEN
    add_bos_token: bool = True
    model_max_length: int | None = None

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], source: str = TOKENIZER_CONFIG_FILE
    ) -> TokenizerConfig:
        """Read the fields we use; a missing field keeps the V4 default."""
        defaults = cls()

        def spelling(field: str, default: str | None) -> str | None:
            value = data.get(field, default)
            if isinstance(value, Mapping):
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{source}: {field} is {value!r}; expected a token string")
            return value

        add_bos = data.get("add_bos_token", defaults.add_bos_token)
        if not isinstance(add_bos, bool):
            raise ValueError(f"{source}: add_bos_token is {add_bos!r}; expected true or false")
        max_length = data.get("model_max_length")
        if max_length is not None and not (isinstance(max_length, int | float) and max_length > 0):
            raise ValueError(
                f"{source}: model_max_length is {max_length!r}; expected a positive int"
            )
        return cls(
            bos_token=spelling("bos_token", defaults.bos_token) or defaults.bos_token,
            eos_token=spelling("eos_token", defaults.eos_token) or defaults.eos_token,
            pad_token=spelling("pad_token", defaults.pad_token),
            add_bos_token=add_bos,
            model_max_length=int(max_length) if max_length is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` content we write (HF-compatible field names)."""
        data: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.model_max_length is not None:
            data["model_max_length"] = self.model_max_length
        return data


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus the V4 chat encoding.

    ``special`` holds the ids of the V4 special tokens found in the vocabulary.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, config: TokenizerConfig | None = None
    ) -> None:
        self.backend = backend
        self.config = config or TokenizerConfig()
        pad = self.config.pad_token if self.config.pad_token is not None else PAD_TOKEN
        self.special: SpecialTokenIds = resolve_special_token_ids(
            backend.token_to_id,
            bos_token=self.config.bos_token,
            eos_token=self.config.eos_token,
            pad_token=pad,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int:
        return self.special.bos

    @property
    def eos_token_id(self) -> int:
        return self.special.eos

    @property
    def pad_token_id(self) -> int | None:
        return self.special.pad

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token spellings in it become their single ids.

        ``add_bos=None`` follows ``add_bos_token`` of the config. Nothing else is added.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.config.add_bos_token if add_bos is None else add_bos:
            ids.insert(0, self.special.bos)
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool | None = None) -> list[list[int]]:
        """``encode`` for many texts (parallel inside ``tokenizers``)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        with_bos = self.config.add_bos_token if add_bos is None else add_bos
        return [([self.special.bos] if with_bos else []) + e.ids for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; keep special tokens (the default) when the text will be parsed."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, ids: Iterator[int], *, skip_special_tokens: bool = False
    ) -> Iterator[str]:
        """Text deltas of a stream of ids; a character split across tokens waits until whole."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in ids:
            piece = stream.step(self.backend, token_id)
            if piece:
                yield piece

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """Token ids of ``encode_messages(messages, **options)`` (its BOS included)."""
        if not self.special.has_chat_tokens:
            raise ValueError("this tokenizer lacks the V4 chat tokens (<｜User｜>, <think>, ...)")
        return self.encode(encode_messages(messages, **options), add_bos=False)

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        config_text = json.dumps(self.config.to_dict(), indent=2, ensure_ascii=False)
        (directory / TOKENIZER_CONFIG_FILE).write_text(config_text + "\n", encoding="utf-8")
        return directory


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (or a directory holding only it).

    ``tokenizer.json`` is required; ``tokenizer_config.json`` is optional (V4 defaults).
    """
    directory = Path(path)
    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} in {directory}; expected a tokenizer directory"
        )
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config_file = directory / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return Tokenizer(backend)
    data = json.loads(config_file.read_text(encoding="utf-8"))
    config = TokenizerConfig.from_dict(data, source=str(config_file))
    if data.get("pad_token") is not None and backend.token_to_id(config.pad_token) is None:
        raise ValueError(f"{config_file}: pad_token {config.pad_token!r} is not in the vocabulary")
    return Tokenizer(backend, config)
