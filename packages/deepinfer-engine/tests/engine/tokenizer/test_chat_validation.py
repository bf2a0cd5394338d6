"""Message validation: bad input fails with the field, the value and what was expected."""

from __future__ import annotations

import pytest

from deepinfer.engine.tokenizer import (
    ChatFormatError,
    ToolResult,
    encode_messages,
    normalize_messages,
)

USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize(
    ("messages", "options", "pieces"),
    [
        ([], {}, ["messages", "non-empty list"]),
        ("hello", {}, ["messages", "non-empty list"]),
        ([{"role": "bot", "content": "x"}], {}, ["messages[0].role", "'bot'", "one of"]),
        ([{"content": "x"}], {}, ["messages[0].role", "None"]),
        ([USER, {"role": "user"}], {}, ["messages[1].content", "content for role 'user'"]),
        ([{"role": "system", "content": None}], {}, ["messages[0].content"]),
        ([{"role": "developer", "content": ""}], {}, ["messages[0].content", "non-empty"]),
        ([{"role": "user", "content": 7}], {}, ["messages[0].content", "a string or a list"]),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, ["messages[0].content[0]"]),
        ([USER, {"role": "assistant"}], {}, ["messages[1].content", "tool_calls"]),
        (
            [USER, {"role": "assistant", "content": "a", "reasoning_content": 3}],
            {},
            ["reasoning_content"],
        ),
        ([{"role": "user", "content": "x", "task": "poem"}], {}, ["messages[0].task", "'poem'"]),
        ([{"role": "tool", "content": "r", "tool_call_id": 5}], {}, ["tool_call_id", "a string"]),
        ([USER], {"reasoning_effort": "extreme"}, ["reasoning_effort", "'extreme'"]),
        ([USER], {"thinking": "yes"}, ["thinking", "'yes'"]),
    ],
)
def test_bad_messages_name_the_field(messages, options, pieces):
    with pytest.raises(ChatFormatError) as error:
        encode_messages(messages, **options)
    for piece in pieces:
        assert piece in str(error.value)


@pytest.mark.parametrize(
    ("tool", "pieces"),
    [
        ("get_weather", ["tools[0]", "tool definition"]),
        ({"type": "function", "function": {"description": "no name"}}, ["tools[0].function.name"]),
        ({"type": "retrieval", "function": {"name": "f"}}, ["tools[0].type", "'retrieval'"]),
        ({"function": {"name": "f", "description": 5}}, ["tools[0].function.description"]),
        ({"function": {"name": "f", "parameters": "{}"}}, ["tools[0].function.parameters"]),
        (
            {"function": {"name": "f", "parameters": {"type": "array"}}},
            ["parameters.type", "'array'"],
        ),
        ({"function": {"name": "f", "parameters": {"properties": []}}}, ["parameters.properties"]),
        ({"function": {"name": "f", "parameters": {"default": {1, 2}}}}, ["JSON-serialisable"]),
    ],
)
def test_bad_tool_schemas_name_the_field(tool, pieces):
    with pytest.raises(ChatFormatError) as error:
        encode_messages([USER], tools=[tool])
    for piece in pieces:
        assert piece in str(error.value)


@pytest.mark.parametrize(
    ("call", "pieces"),
    [
        ({"function": {"name": "", "arguments": "{}"}}, ["tool_calls[0].function.name"]),
        (
            {"function": {"name": "f", "arguments": "{not json"}},
            ["function.arguments", "JSON text"],
        ),
        ({"function": {"name": "f", "arguments": "[1, 2]"}}, ["function.arguments", "object"]),
        ({"function": {"name": "f", "arguments": 3}}, ["function.arguments"]),
        (
            {"function": {"name": "f", "arguments": {'a"b': 1}}},
            ["function.arguments", "argument names"],
        ),
        ({"id": 9, "function": {"name": "f", "arguments": {}}}, ["tool_calls[0].id"]),
    ],
)
def test_bad_tool_calls_name_the_field(call, pieces):
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ChatFormatError) as error:
        encode_messages(messages)
    for piece in ["messages[1].tool_calls[0]", *pieces]:
        assert piece in str(error.value)


def test_tool_results_merge_into_one_user_turn_in_call_order():
    calls = [{"id": f"id{i}", "function": {"name": "f", "arguments": {"i": i}}} for i in range(3)]
    messages = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "id2", "content": "two"},
        {"role": "tool", "tool_call_id": "id0", "content": [{"type": "text", "text": "zero"}]},
        {"role": "tool", "tool_call_id": "id1", "content": "one"},
        {"role": "user", "content": "Summarise."},
    ]
    turns = normalize_messages(messages)
    assert [turn.role for turn in turns] == ["user", "assistant", "user"]
    assert turns[2].parts == (
        ToolResult("zero", "id0"),
        ToolResult("one", "id1"),
        ToolResult("two", "id2"),
        "Summarise.",
    )


def test_messages_are_not_modified():
    messages = [{"role": "system", "content": "S"}, dict(USER)]
    snapshot = [dict(message) for message in messages]
    encode_messages(messages, tools=[{"function": {"name": "f"}}], thinking=True)
    assert messages == snapshot
