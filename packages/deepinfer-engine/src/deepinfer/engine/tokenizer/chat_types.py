"""Plain data of the chat format: validated messages, tool calls, tool results, parsed output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
"""Roles ``encode_messages`` accepts (``tool`` messages are merged into a user turn)."""


class ChatFormatError(ValueError):
    """A message list, tool schema or completion text that does not fit the V4 chat format."""


def to_json(value: Any) -> str:
    """JSON text as the V4 format writes it: ``", "`` / ``": "`` separators, Unicode kept."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is the JSON text of an object (OpenAI convention)."""

    name: str
    arguments: str
    id: str | None = None

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments decoded from JSON."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "arguments"}}`` (+ ``id`` when known)."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass(frozen=True)
class ToolResult:
    """The output of one tool call, rendered as ``<tool_result>content</tool_result>``."""

    content: str
    tool_call_id: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One validated message (``tool`` messages already merged into ``user`` parts).

    ``parts`` (user only): text pieces and tool results, joined by a blank line when rendered.
    ``tools``: function schemas (``{"name", "description", "parameters"}``) the system or
    developer message declares. ``task``: a quick-instruction task name (see TASK_TOKENS).
    """

    role: str
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    response_format: dict[str, Any] | None = None
    parts: tuple[str | ToolResult, ...] = ()
    task: str | None = None


@dataclass(frozen=True)
class ParsedCompletion:
    """An assistant completion split into its reasoning, visible content and tool calls."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default=())

    def to_message(self) -> dict[str, Any]:
        """The OpenAI-style assistant message (``tool_calls`` only when there are some)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning_content,
        }
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message
