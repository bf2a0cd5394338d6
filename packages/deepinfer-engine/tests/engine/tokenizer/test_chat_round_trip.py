"""Encode -> parse round trips (issue 3: "Chat encoding round-trips the spec's examples").

For a conversation ending in an assistant turn, the prompt of the conversation without that
turn (with the generation prompt) must be a prefix of the prompt with it, and parsing the rest
-- the turn as the model would generate it -- must give the turn back. Spec deepseek-v4.md
section 5: system, multi-turn, thinking and chat modes, tool calls and tool results.
"""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine.tokenizer import encode_messages, parse_completion, testing_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


def split_last_turn(messages: list[dict], **options) -> str:
    """The text of the final assistant turn, as generated after the prompt of the rest."""
    prompt = encode_messages(messages[:-1], **options)
    full = encode_messages(messages, **options)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def assert_turn_round_trips(messages: list[dict], *, thinking: bool, **options) -> None:
    completion = split_last_turn(messages, thinking=thinking, **options)
    parsed = parse_completion(completion, thinking=thinking, strict=True).to_message()
    turn = messages[-1]
    assert parsed["content"] == (turn.get("content") or "")
    assert parsed["reasoning_content"] == (
        (turn.get("reasoning_content") or "") if thinking else ""
    )
    expected_calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in turn.get("tool_calls", [])
    ]
    parsed_calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in parsed.get("tool_calls", [])
    ]
    assert parsed_calls == expected_calls


def tool_call(call_id: str, word: str) -> dict:
    arguments = json.dumps({"word": word, "max_senses": 2})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "lookup", "arguments": arguments},
    }


CONVERSATIONS = {
    "single_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
    ],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: Paris."},
    ],
    "tool_call": [
        SYSTEM,
        {"role": "user", "content": "Define 'ossify' and 'fettle'."},
        {
            "role": "assistant",
            "content": "Looking both up.",
            "reasoning_content": "Two lookups.",
            "tool_calls": [tool_call("c1", "ossify"), tool_call("c2", "fettle")],
        },
    ],
    "after_tool_results": [
        SYSTEM,
        {"role": "user", "content": "Define 'ossify'."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Lookup.",
            "tool_calls": [tool_call("c1", "ossify")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "to harden into bone"},
        {
            "role": "assistant",
            "content": "It means to harden into bone.",
            "reasoning_content": "Got it.",
        },
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [False, True])
def test_spec_conversations_round_trip(name, thinking):
    uses_tools = "tool" in name
    assert_turn_round_trips(
        CONVERSATIONS[name], thinking=thinking, tools=TOOLS if uses_tools else None
    )


@pytest.mark.parametrize("seed", range(20))
def test_random_assistant_turns_round_trip(seed):
    rng = random.Random(seed)
    alphabet = ["w", "Q", " ", "\n", "<", ">", "/", '"', "{", "}", "é", "中", "\t", "\\"]

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))

    calls = [
        {
            "id": f"c{i}",
            "function": {
                "name": f"f{i}",
                "arguments": {"s": text(), "n": rng.randint(-9, 9), "l": [text()]},
            },
        }
        for i in range(rng.randint(0, 2))
    ]
    turn = {"role": "assistant", "content": text(), "reasoning_content": text()}
    if calls:
        turn["tool_calls"] = calls
    messages = [{"role": "user", "content": text() or "x"}, turn]
    thinking = bool(seed % 2)
    completion = split_last_turn(messages, thinking=thinking)
    parsed = parse_completion(completion, thinking=thinking, strict=True)
    assert parsed.content == turn["content"]
    assert parsed.reasoning_content == (turn["reasoning_content"] if thinking else "")
    assert [c.arguments_dict() for c in parsed.tool_calls] == [
        c["function"]["arguments"] for c in calls
    ]


def test_round_trip_through_token_ids():
    tokenizer = testing_tokenizer()
    messages = CONVERSATIONS["tool_call"]
    ids = tokenizer.encode_chat(messages, thinking=True, tools=TOOLS)
    prompt_ids = tokenizer.encode_chat(messages[:-1], thinking=True, tools=TOOLS)
    assert ids[: len(prompt_ids)] == prompt_ids  # the turn starts on a token boundary
    assert ids[0] == tokenizer.bos_token_id
    assert ids[-1] == tokenizer.eos_token_id
    completion = tokenizer.decode(ids[len(prompt_ids) :])
    parsed = parse_completion(completion, thinking=True, strict=True)
    assert parsed.reasoning_content == "Two lookups."
    assert [c.arguments_dict()["word"] for c in parsed.tool_calls] == ["ossify", "fettle"]
