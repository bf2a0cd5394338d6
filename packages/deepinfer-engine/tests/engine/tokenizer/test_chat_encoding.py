"""Byte-exact V4 prompts, written out by hand from spec deepseek-v4.md section 5 ("Chat encoding").

Each expected string spells the format rules of that section directly (BOS, role tokens, the
``<think>`` / ``</think>`` after ``<｜Assistant｜>``, EOS after each assistant turn, DSML tool
calls, ``<tool_result>`` blocks), so a change in the encoder shows up here as a diff.
"""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.tokenizer import encode_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "You are a helpful assistant."

# The "## Tools" section the system turn gains (spec section 5: "content verbatim (+ "\n\n" +
# a Tools section ...)"); text of DeepSeek's encoder, source S15 of the spec.
TOOLS_SECTION_HEAD = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""  # noqa: E501
TOOLS_SECTION_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_SCHEMA_LINE = (
    '{"name": "get_weather", "description": "Current weather of a city.", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}'
)


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!", "reasoning_content": "The user greets me."},
        {"role": "user", "content": "What is 2+2?"},
    ]


def test_chat_mode_system_and_single_user_turn():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    expected = f"{BOS}{SYSTEM}{USER}Hi{ASSISTANT}</think>"
    assert encode_messages(messages) == expected


def test_thinking_mode_opens_the_reasoning():
    expected = f"{BOS}{USER}Hi{ASSISTANT}<think>"
    assert encode_messages([{"role": "user", "content": "Hi"}], thinking=True) == expected


def test_chat_mode_multi_turn_never_shows_reasoning():
    expected = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there!{EOS}"
        f"{USER}What is 2+2?{ASSISTANT}</think>"
    )
    assert encode_messages(conversation()) == expected


def test_thinking_mode_multi_turn_drops_earlier_reasoning():
    # Spec: "reasoning is kept only for turns after the last user message when drop_thinking
    # (default) is on"; historical turns get "</think>" after <｜Assistant｜>.
    expected = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there!{EOS}"
        f"{USER}What is 2+2?{ASSISTANT}<think>"
    )
    assert encode_messages(conversation(), thinking=True) == expected


def test_thinking_mode_keeps_reasoning_without_drop_thinking():
    expected = (
        f"{BOS}{SYSTEM}{USER}Hello{ASSISTANT}<think>The user greets me.</think>Hi there!{EOS}"
        f"{USER}What is 2+2?{ASSISTANT}<think>"
    )
    assert encode_messages(conversation(), thinking=True, drop_thinking=False) == expected


def test_assistant_turns_after_the_last_user_keep_reasoning():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    ]
    expected = f"{BOS}{USER}Hi{ASSISTANT}<think>Greet back.</think>Hello!{EOS}"
    assert encode_messages(messages, thinking=True) == expected
    # Chat mode renders the same turn without its reasoning.
    assert encode_messages(messages) == f"{BOS}{USER}Hi{ASSISTANT}</think>Hello!{EOS}"


def test_add_generation_prompt_false_stops_after_the_user_turn():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    assert encode_messages(messages, add_generation_prompt=False) == f"{BOS}{SYSTEM}{USER}Hi"
    assert encode_messages(messages, add_bos=False).startswith(SYSTEM)


def test_reasoning_effort_max_prefix_only_in_thinking_mode():
    prefix = (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem "
        "to resolve the root cause, rigorously stress-testing your logic against all potential "
        "paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate "
        "step, considered alternative, and rejected hypothesis to ensure absolutely no "
        "assumption is left unchecked.\n\n"
    )
    messages = [{"role": "user", "content": "Prove it."}]
    expected = f"{BOS}{prefix}{USER}Prove it.{ASSISTANT}<think>"
    assert encode_messages(messages, thinking=True, reasoning_effort="max") == expected
    assert encode_messages(messages, thinking=True, reasoning_effort="high") == (
        f"{BOS}{USER}Prove it.{ASSISTANT}<think>"
    )
    assert (
        encode_messages(messages, reasoning_effort="max")
        == f"{BOS}{USER}Prove it.{ASSISTANT}</think>"
    )


def tool_conversation() -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        # Results arrive out of order: the encoder sorts them into call order.
        {"role": "tool", "tool_call_id": "call_b", "content": "Rome: 25°C"},
        {"role": "tool", "tool_call_id": "call_a", "content": "Paris: 18°C"},
        {"role": "assistant", "content": "Paris 18°C, Rome 25°C.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks!"},
    ]


TOOL_CALLS_BLOCK = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_thinking_mode_with_tools_keeps_all_reasoning_and_merges_tool_results():
    # Spec: tools in the system turn; DSML tool calls after "\n\n"; tool results merged into
    # the next user turn as <tool_result> blocks in call order joined by "\n\n"; with tools,
    # thinking is never dropped.
    expected = (
        f"{BOS}{SYSTEM}\n\n{TOOLS_SECTION_HEAD}{WEATHER_SCHEMA_LINE}{TOOLS_SECTION_TAIL}"
        f"{USER}Weather in Paris and Rome?{ASSISTANT}<think>Two cities, two calls.</think>"
        f"\n\n{TOOL_CALLS_BLOCK}{EOS}"
        f"{USER}<tool_result>Paris: 18°C</tool_result>\n\n<tool_result>Rome: 25°C</tool_result>"
        f"{ASSISTANT}<think>Done.</think>Paris 18°C, Rome 25°C.{EOS}"
        f"{USER}Thanks!{ASSISTANT}<think>"
    )
    assert encode_messages(tool_conversation(), thinking=True, tools=[WEATHER_TOOL]) == expected


def test_chat_mode_with_tools_and_a_new_system_turn():
    # Without a leading system message, the tools go on an inserted empty one.
    messages = tool_conversation()[1:5]
    expected = (
        f"{BOS}\n\n{TOOLS_SECTION_HEAD}{WEATHER_SCHEMA_LINE}{TOOLS_SECTION_TAIL}"
        f"{USER}Weather in Paris and Rome?{ASSISTANT}</think>\n\n{TOOL_CALLS_BLOCK}{EOS}"
        f"{USER}<tool_result>Paris: 18°C</tool_result>\n\n<tool_result>Rome: 25°C</tool_result>"
        f"{ASSISTANT}</think>"
    )
    assert encode_messages(messages, tools=[WEATHER_TOOL]) == expected


def test_tools_declared_on_the_system_message_equal_the_tools_argument():
    with_argument = encode_messages(tool_conversation(), thinking=True, tools=[WEATHER_TOOL])
    messages = tool_conversation()
    messages[0]["tools"] = [WEATHER_TOOL]
    assert encode_messages(messages, thinking=True) == with_argument


def test_tool_call_content_and_json_values():
    arguments = {"query": 'say "hi"\nnow', "limit": 3.5, "flags": [True, None], "opts": {"a": 1}}
    messages = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [{"function": {"name": "search", "arguments": json.dumps(arguments)}}],
        },
    ]
    expected = (
        f"{BOS}{USER}Go{ASSISTANT}</think>Searching.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="search">\n'
        '<｜DSML｜parameter name="query" string="true">say "hi"\nnow</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="limit" string="false">3.5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="flags" string="false">[true, null]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": 1}</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}"
    )
    assert encode_messages(messages) == expected


def test_developer_turn_and_its_drop_in_thinking_mode():
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "assistant", "content": "OK.", "reasoning_content": "noted"},
        {"role": "user", "content": "Why?"},
    ]
    assert encode_messages(messages) == (
        f"{BOS}{USER}Answer briefly.{ASSISTANT}</think>OK.{EOS}{USER}Why?{ASSISTANT}</think>"
    )
    # Thinking mode with drop_thinking: developer turns before the last user turn are dropped.
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}OK.{EOS}{USER}Why?{ASSISTANT}<think>"
    )


def test_response_format_block_on_the_system_turn():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    messages = [
        {"role": "system", "content": SYSTEM, "response_format": schema},
        {"role": "user", "content": "2+2?"},
    ]
    expected = (
        f"{BOS}{SYSTEM}\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
        'schema to reply:\n{"type": "object", "properties": {"answer": {"type": "integer"}}}'
        f"{USER}2+2?{ASSISTANT}</think>"
    )
    assert encode_messages(messages) == expected


def test_consecutive_user_messages_and_text_parts_join_with_a_blank_line():
    messages = [
        {"role": "user", "content": "First."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Sec"}, {"type": "text", "text": "ond."}],
        },
    ]
    assert encode_messages(messages) == f"{BOS}{USER}First.\n\nSec\n\nond.{ASSISTANT}</think>"


@pytest.mark.parametrize(
    ("task", "thinking", "suffix"),
    [
        ("query", False, "<｜query｜>"),
        ("title", True, "<｜title｜>"),
        ("action", False, f"{ASSISTANT}</think><｜action｜>"),
        ("action", True, f"{ASSISTANT}<think><｜action｜>"),
    ],
)
def test_task_tokens_replace_the_assistant_header(task, thinking, suffix):
    messages = [{"role": "user", "content": "Paris trip", "task": task}]
    assert encode_messages(messages, thinking=thinking) == f"{BOS}{USER}Paris trip{suffix}"


def test_latest_reminder_turn():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "latest_reminder", "content": "Today is Monday."},
    ]
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}{USER}Hi{ASSISTANT}<think><｜latest_reminder｜>Today is Monday."
    )
