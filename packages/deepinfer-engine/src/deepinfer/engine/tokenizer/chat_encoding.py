"""Render a conversation into the DeepSeek-V4 prompt text (``encoding_dsv4`` behaviour).

Spec deepseek-v4.md section 5, in short::

    prompt    = BOS + turn + turn + ...                      (no newlines between turns)
    system    = content [+ "\\n\\n" + tools section] [+ "\\n\\n" + response-format block]
    developer = <｜User｜> + content [+ tools] [+ response format]
    user      = <｜User｜> + parts joined by "\\n\\n"   (tool results as <tool_result>…</tool_result>)
    assistant = [reasoning + </think>] + content [+ "\\n\\n" + DSML tool calls] + EOS

A user (or developer) turn that is last or followed by an assistant turn ends with
``<｜Assistant｜>`` and then ``<think>`` when that assistant turn thinks, ``</think>`` when it
does not (chat mode, or an earlier turn whose reasoning was dropped).

Thinking mode drops the reasoning of assistant turns before the last user turn (and those
turns' developer messages) unless any message declares tools; then all reasoning is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from deepinfer.engine.tokenizer.chat_types import ChatFormatError, ChatMessage, ToolResult, to_json
from deepinfer.engine.tokenizer.dsml import TOOL_CALLS_SEPARATOR, render_tool_calls
from deepinfer.engine.tokenizer.special_tokens import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    LATEST_REMINDER_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)
from deepinfer.engine.tokenizer.templates import (
    REASONING_EFFORT_MAX_PREFIX,
    RESPONSE_FORMAT_HEADER,
    render_tools_section,
)
from deepinfer.engine.tokenizer.validation import normalize_messages

REASONING_EFFORTS = (None, "high", "max")
"""Accepted ``reasoning_effort`` values; only ``"max"`` changes the prompt."""


def _last_user_index(turns: Sequence[ChatMessage]) -> int:
    for index in range(len(turns) - 1, -1, -1):
        if turns[index].role in ("user", "developer"):
            return index
    return -1


def _drop_earlier_reasoning(turns: list[ChatMessage]) -> list[ChatMessage]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go."""
    last_user = _last_user_index(turns)
    kept = []
    for index, turn in enumerate(turns):
        if index >= last_user or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning_content=None))
    return kept


def _declarations(turn: ChatMessage) -> str:
    """The tools section and response-format block a system/developer turn appends."""
    text = ""
    if turn.tools:
        text += "\n\n" + render_tools_section([to_json(tool) for tool in turn.tools])
    if turn.response_format is not None:
        text += "\n\n" + RESPONSE_FORMAT_HEADER + to_json(turn.response_format)
    return text


def _render_part(part: str | ToolResult) -> str:
    if isinstance(part, ToolResult):
        return f"<tool_result>{part.content}</tool_result>"
    return part


def _render_body(turn: ChatMessage, reasoning_shown: bool) -> str:
    """A turn's own text, without what follows it (the assistant header)."""
    if turn.role == "system":
        return turn.content + _declarations(turn)
    if turn.role == "developer":
        return USER_TOKEN + turn.content + _declarations(turn)
    if turn.role == "user":
        return USER_TOKEN + "\n\n".join(_render_part(part) for part in turn.parts)
    if turn.role == "latest_reminder":
        return LATEST_REMINDER_TOKEN + turn.content
    reasoning = (turn.reasoning_content or "") + THINK_END_TOKEN if reasoning_shown else ""
    tool_calls = (
        TOOL_CALLS_SEPARATOR + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    )
    return reasoning + turn.content + tool_calls + EOS_TOKEN


def _render_suffix(turn: ChatMessage, thinks: bool, is_thinking_mode: bool) -> str:
    """What opens the next assistant turn after ``turn`` (task token or assistant header)."""
    if turn.task is not None:
        if turn.task != "action":
            return TASK_TOKENS[turn.task]
        think_token = THINK_START_TOKEN if is_thinking_mode else THINK_END_TOKEN
        return ASSISTANT_TOKEN + think_token + TASK_TOKENS["action"]
    if turn.role in ("user", "developer"):
        return ASSISTANT_TOKEN + (THINK_START_TOKEN if thinks else THINK_END_TOKEN)
    return ""


def _render_turns(
    turns: list[ChatMessage],
    *,
    thinking: bool,
    keep_all_reasoning: bool,
    add_generation_prompt: bool,
) -> str:
    last_user = _last_user_index(turns)
    text = ""
    for index, turn in enumerate(turns):
        follows_task = index > 0 and turns[index - 1].task is not None
        # An assistant turn shows reasoning when thinking is on for it: every turn when
        # reasoning is kept, otherwise only the turns after the last user turn.
        reasoning_shown = (
            thinking and not follows_task and (keep_all_reasoning or index > last_user)
        )
        text += _render_body(turn, reasoning_shown)
        is_last = index + 1 == len(turns)
        opens_next = not is_last and turns[index + 1].role in ("assistant", "latest_reminder")
        if opens_next or (is_last and add_generation_prompt):
            thinks = thinking and (keep_all_reasoning or index >= last_user)
            text += _render_suffix(turn, thinks, thinking)
    return text


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """Render OpenAI-style ``messages`` into the V4 prompt text.

    Args:
        messages: dicts with ``role`` in system / developer / user / assistant / tool /
            latest_reminder; ``content`` (a string or a list of text parts); assistant turns
            may carry ``reasoning_content`` and ``tool_calls``; tool turns ``tool_call_id``;
            system / developer turns ``tools`` and ``response_format``; user / developer
            turns ``task``.
        thinking: thinking mode (the assistant reasons inside ``<think>``) or chat mode.
        reasoning_effort: None, "high" or "max"; "max" prepends a fixed instruction to the
            first turn in thinking mode.
        tools: tool definitions, declared on the leading system turn (inserted if absent).
        add_generation_prompt: end with the assistant header after a final user turn.
        drop_thinking: drop the reasoning of turns before the last user turn (thinking mode;
            ignored when any turn declares tools).
        add_bos: start with the BOS token (False when continuing an encoded prefix).

    Returns:
        The prompt text; tokenize it without adding special tokens.

    Raises:
        ChatFormatError: naming the field, the value and what was expected.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(
            f"reasoning_effort: got {reasoning_effort!r}; expected one of {list(REASONING_EFFORTS)}"
        )
    if not isinstance(thinking, bool):
        raise ChatFormatError(f"thinking: got {thinking!r}; expected True or False")
    turns = normalize_messages(messages, tools)
    keep_all_reasoning = not drop_thinking or any(turn.tools for turn in turns)
    if thinking and not keep_all_reasoning:
        turns = _drop_earlier_reasoning(turns)
    text = _render_turns(
        turns,
        thinking=thinking,
        keep_all_reasoning=keep_all_reasoning,
        add_generation_prompt=add_generation_prompt,
    )
    if thinking and reasoning_effort == "max":
        text = REASONING_EFFORT_MAX_PREFIX + text
    return (BOS_TOKEN if add_bos else "") + text
