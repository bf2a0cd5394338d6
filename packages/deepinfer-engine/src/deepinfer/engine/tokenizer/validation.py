"""Validate OpenAI-style message dicts and normalise them into ``ChatMessage``s.

Errors name the offending field as a path (``messages[2].tool_calls[0].function.name``), the
value, and what was expected. Normalisation follows spec deepseek-v4.md section 5: ``tool``
messages become ``<tool_result>`` parts of a user turn (sorted into the order of the preceding
assistant's tool calls), and consecutive user messages join into one turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from deepinfer.engine.tokenizer.chat_types import (
    ROLES,
    ChatFormatError,
    ChatMessage,
    ToolCall,
    ToolResult,
    to_json,
)
from deepinfer.engine.tokenizer.special_tokens import TASK_TOKENS


def _fail(where: str, value: Any, expected: str) -> ChatFormatError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ChatFormatError(f"{where}: got {shown}; expected {expected}")


def _text(value: Any, where: str) -> str:
    """A string, or a list of ``{"type": "text", "text": ...}`` parts joined by a blank line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise _fail(f"{where}[{index}]", part, 'a {"type": "text", "text": str} part')
            if not isinstance(part.get("text"), str):
                raise _fail(f"{where}[{index}].text", part.get("text"), "a string")
            texts.append(part["text"])
        return "\n\n".join(texts)
    raise _fail(where, value, "a string or a list of text parts")


def _required_text(message: Mapping[str, Any], where: str) -> str:
    if "content" not in message or message["content"] is None:
        raise _fail(
            f"{where}.content", message.get("content"), f"content for role {message['role']!r}"
        )
    return _text(message["content"], f"{where}.content")


def validate_tool(tool: Any, where: str) -> dict[str, Any]:
    """A tool definition (OpenAI ``{"type": "function", "function": {...}}`` or the bare
    function) -> the function schema dict ``{"name", "description"?, "parameters"?}``."""
    if not isinstance(tool, Mapping):
        raise _fail(where, tool, "a tool definition mapping")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise _fail(f"{where}.type", tool.get("type"), '"function"')
        where, function = f"{where}.function", tool["function"]
    else:
        function = tool
    if not isinstance(function, Mapping):
        raise _fail(where, function, "a function schema mapping")
    name = function.get("name")
    if not (isinstance(name, str) and name):
        raise _fail(f"{where}.name", name, "a non-empty string")
    if "description" in function and not isinstance(function["description"], str):
        raise _fail(f"{where}.description", function["description"], "a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise _fail(f"{where}.parameters", parameters, "a JSON schema object")
        if parameters.get("type", "object") != "object":
            raise _fail(f"{where}.parameters.type", parameters.get("type"), '"object"')
        if not isinstance(parameters.get("properties", {}), Mapping):
            raise _fail(f"{where}.parameters.properties", parameters.get("properties"), "a mapping")
    try:
        to_json(function)
    except (TypeError, ValueError) as error:
        raise _fail(where, function, f"a JSON-serialisable schema ({error})") from None
    return dict(function)


def _validate_tools(tools: Any, where: str) -> tuple[dict[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise _fail(where, tools, "a list of tool definitions")
    return tuple(validate_tool(tool, f"{where}[{index}]") for index, tool in enumerate(tools))


def validate_tool_call(call: Any, where: str) -> ToolCall:
    """An OpenAI tool call (or bare ``{"name", "arguments"}``) -> ``ToolCall``.

    ``arguments`` may be JSON text or a dict; either way it must be a JSON object.
    """
    if not isinstance(call, Mapping):
        raise _fail(where, call, "a tool call mapping")
    function = call.get("function", call)
    fwhere = f"{where}.function" if "function" in call else where
    if not isinstance(function, Mapping):
        raise _fail(fwhere, function, "a mapping with name and arguments")
    name = function.get("name")
    if not (isinstance(name, str) and name):
        raise _fail(f"{fwhere}.name", name, "a non-empty string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            raise _fail(f"{fwhere}.arguments", arguments, "JSON text of an object") from None
        if not isinstance(decoded, dict):
            raise _fail(f"{fwhere}.arguments", arguments, "JSON text of an object")
    elif isinstance(arguments, Mapping):
        decoded, arguments = dict(arguments), to_json(dict(arguments))
    else:
        raise _fail(f"{fwhere}.arguments", arguments, "a JSON object (text or dict)")
    for key in decoded:
        if '"' in key or "\n" in key:
            raise _fail(f"{fwhere}.arguments", key, "argument names without '\"' or newlines")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise _fail(f"{where}.id", call_id, "a string")
    return ToolCall(name=name, arguments=arguments, id=call_id)


def _validate_task(message: Mapping[str, Any], where: str) -> str | None:
    task = message.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise _fail(f"{where}.task", task, f"one of {sorted(TASK_TOKENS)}")
    return task


def _validate_response_format(message: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    response_format = message.get("response_format")
    if response_format is not None and not isinstance(response_format, Mapping):
        raise _fail(f"{where}.response_format", response_format, "a JSON schema mapping")
    return dict(response_format) if response_format is not None else None


def _validate_assistant(message: Mapping[str, Any], where: str) -> ChatMessage:
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, str):
        raise _fail(f"{where}.tool_calls", raw_calls, "a list of tool calls")
    if message.get("content") is None and not raw_calls and "reasoning_content" not in message:
        raise _fail(f"{where}.content", None, "content, reasoning_content or tool_calls")
    content = message.get("content")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _fail(f"{where}.reasoning_content", reasoning, "a string")
    return ChatMessage(
        role="assistant",
        content=_text(content, f"{where}.content") if content is not None else "",
        reasoning_content=reasoning,
        tool_calls=tuple(
            validate_tool_call(call, f"{where}.tool_calls[{index}]")
            for index, call in enumerate(raw_calls)
        ),
    )


def _validate_one(message: Any, where: str) -> ChatMessage | ToolResult:
    if not isinstance(message, Mapping):
        raise _fail(where, message, "a message mapping with a role")
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{where}.role", role, f"one of {list(ROLES)}")
    if role == "assistant":
        return _validate_assistant(message, where)
    content = _required_text(message, where)
    if role == "tool":
        call_id = message.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise _fail(f"{where}.tool_call_id", call_id, "a string")
        return ToolResult(content=content, tool_call_id=call_id)
    if role == "developer" and not content:
        raise _fail(f"{where}.content", content, "non-empty content for role 'developer'")
    return ChatMessage(
        role=role,
        content=content,
        tools=_validate_tools(message.get("tools"), f"{where}.tools"),
        response_format=_validate_response_format(message, where),
        parts=(content,) if role == "user" else (),
        task=_validate_task(message, where),
    )


def _merge_into_user_turns(items: list[ChatMessage | ToolResult]) -> list[ChatMessage]:
    """Tool results join the preceding user turn (or start one); consecutive user messages
    without a task join into one turn."""
    merged: list[ChatMessage] = []
    for item in items:
        previous = merged[-1] if merged and merged[-1].role == "user" else None
        if isinstance(item, ToolResult):
            if previous is not None:
                merged[-1] = replace(previous, parts=(*previous.parts, item))
            else:
                merged.append(ChatMessage(role="user", parts=(item,)))
        elif (
            item.role == "user"
            and previous is not None
            and previous.task is None
            and item.task is None
        ):
            merged[-1] = replace(previous, parts=(*previous.parts, *item.parts))
        else:
            merged.append(item)
    return merged


def _sort_tool_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Within each user turn, order tool results as the last assistant issued the calls."""
    call_order: dict[str, int] = {}
    result = []
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            call_order = {call.id: i for i, call in enumerate(message.tool_calls) if call.id}
        elif message.role == "user" and call_order:
            slots = [i for i, part in enumerate(message.parts) if isinstance(part, ToolResult)]
            if len(slots) > 1:
                ordered = sorted(
                    (message.parts[i] for i in slots),
                    key=lambda part: call_order.get(part.tool_call_id, 0),
                )
                parts = list(message.parts)
                for slot, part in zip(slots, ordered, strict=True):
                    parts[slot] = part
                message = replace(message, parts=tuple(parts))
        result.append(message)
    return result


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[ChatMessage]:
    """Validate ``messages`` and return the turns the encoder renders.

    ``tools`` (if given) are declared on the leading system message, or on a new empty system
    message inserted first when the conversation does not start with one.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise _fail("messages", messages, "a non-empty list of message mappings")
    items = [_validate_one(message, f"messages[{i}]") for i, message in enumerate(messages)]
    turns = _sort_tool_results(_merge_into_user_turns(items))
    extra_tools = _validate_tools(tools, "tools")
    if extra_tools:
        if turns[0].role == "system":
            turns[0] = replace(turns[0], tools=(*turns[0].tools, *extra_tools))
        else:
            turns.insert(0, ChatMessage(role="system", tools=extra_tools))
    return turns
