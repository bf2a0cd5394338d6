"""Tokenizer loading, the DeepSeek-V4 chat encoding and the completion parser.

- ``load_tokenizer(directory)`` -> ``Tokenizer`` (``tokenizer.json`` + ``tokenizer_config.json``
  through the ``tokenizers`` library; ``encode``, ``decode``, ``decode_stream``,
  ``encode_chat``, ``special`` ids).
- ``encode_messages(messages, *, thinking, reasoning_effort, tools, add_generation_prompt)``
  -> prompt text in the V4 format (spec deepseek-v4.md section 5).
- ``parse_completion(text, *, thinking)`` / ``CompletionParser`` (streaming) -> reasoning,
  content and DSML tool calls of an assistant completion.
- ``testing_tokenizer()``: a tiny in-memory tokenizer with every V4 special token, for tests;
  ``train_byte_level_bpe`` trains larger ones (the tiny model's).
"""

from deepinfer.engine.tokenizer.chat_encoding import REASONING_EFFORTS, encode_messages
from deepinfer.engine.tokenizer.chat_types import (
    ChatFormatError,
    ChatMessage,
    ParsedCompletion,
    ToolCall,
    ToolResult,
)
from deepinfer.engine.tokenizer.completion_parser import CompletionParser, parse_completion
from deepinfer.engine.tokenizer.dsml import render_tool_calls
from deepinfer.engine.tokenizer.special_tokens import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    DRAFT_NOISE_TOKEN,
    DSML_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    LATEST_REMINDER_TOKEN,
    PAD_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
    V4_SPECIAL_TOKENS,
    SpecialTokenIds,
)
from deepinfer.engine.tokenizer.tokenizer import Tokenizer, TokenizerConfig, load_tokenizer
from deepinfer.engine.tokenizer.training import testing_tokenizer, train_byte_level_bpe
from deepinfer.engine.tokenizer.validation import normalize_messages

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "DRAFT_NOISE_TOKEN",
    "DSML_TOKEN",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "LATEST_REMINDER_TOKEN",
    "PAD_TOKEN",
    "REASONING_EFFORTS",
    "TASK_TOKENS",
    "THINK_END_TOKEN",
    "THINK_START_TOKEN",
    "USER_TOKEN",
    "V4_SPECIAL_TOKENS",
    "ChatFormatError",
    "ChatMessage",
    "CompletionParser",
    "ParsedCompletion",
    "SpecialTokenIds",
    "Tokenizer",
    "TokenizerConfig",
    "ToolCall",
    "ToolResult",
    "encode_messages",
    "load_tokenizer",
    "normalize_messages",
    "parse_completion",
    "render_tool_calls",
    "testing_tokenizer",
    "train_byte_level_bpe",
]
