"""Parsing completions (spec deepseek-v4.md section 5, "Parsing reverses this"), whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine.tokenizer import (
    ChatFormatError,
    CompletionParser,
    ParsedCompletion,
    ToolCall,
    parse_completion,
    render_tool_calls,
    testing_tokenizer,
)

EOS = "<｜end▁of▁sentence｜>"

PIECES = [
    "a",
    "Z",
    " ",
    "\n",
    "<",
    ">",
    "/",
    '"',
    "{",
    "}",
    "=",
    "°C",
    "你好",
    "think",
    "DSML",
    "｜",
    "x=1",
]


def random_text(rng: random.Random, max_pieces: int = 12) -> str:
    """Random text that can hold markup-like characters but no V4 special token."""
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, max_pieces)))


def random_json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return random_text(rng)
    if kind == 1:
        return rng.randint(-1000, 1000)
    if kind == 2:
        return round(rng.uniform(-10, 10), 3)
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_json_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_tool_calls(rng: random.Random) -> list[ToolCall]:
    calls = []
    for index in range(rng.randint(1, 3)):
        arguments = {f"arg_{j}": random_json_value(rng) for j in range(rng.randint(0, 4))}
        calls.append(ToolCall(name=f"tool_{index}", arguments=json.dumps(arguments)))
    return calls


def completion_text(reasoning: str | None, content: str, calls: list[ToolCall]) -> str:
    """The completion the format prescribes (what the model should generate)."""
    text = "" if reasoning is None else reasoning + "</think>"
    text += content
    if calls:
        text += "\n\n" + render_tool_calls(calls)
    return text + EOS


def assert_same_calls(parsed: tuple[ToolCall, ...], expected: list[ToolCall]) -> None:
    assert [call.name for call in parsed] == [call.name for call in expected]
    assert [call.arguments_dict() for call in parsed] == [
        call.arguments_dict() for call in expected
    ]


def test_parse_thinking_completion_with_tool_calls():
    text = (
        "Need data.</think>Let me check.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
    )
    parsed = parse_completion(text, thinking=True, strict=True)
    assert parsed.reasoning_content == "Need data."
    assert parsed.content == "Let me check."
    assert parsed.tool_calls == (
        ToolCall(name="get_weather", arguments='{"city": "Paris", "days": 3}'),
    )
    message = parsed.to_message()
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_parse_chat_completion_with_and_without_eos():
    assert parse_completion("Hello!" + EOS, thinking=False, strict=True) == ParsedCompletion(
        content="Hello!"
    )
    assert parse_completion("Hello!", thinking=False, strict=True).content == "Hello!"


def test_tool_call_without_arguments():
    calls = [ToolCall(name="now", arguments="{}")]
    parsed = parse_completion(completion_text("r", "", calls), thinking=True, strict=True)
    assert_same_calls(parsed.tool_calls, calls)


@pytest.mark.parametrize("seed", range(40))
def test_random_completions_parse_back(seed):
    rng = random.Random(seed)
    thinking = rng.random() < 0.6
    reasoning = random_text(rng) if thinking else None
    content = random_text(rng) if rng.random() < 0.7 else ""
    calls = random_tool_calls(rng) if rng.random() < 0.6 else []
    parsed = parse_completion(
        completion_text(reasoning, content, calls), thinking=thinking, strict=True
    )
    assert parsed.reasoning_content == (reasoning or "")
    assert parsed.content == content
    assert_same_calls(parsed.tool_calls, calls)


@pytest.mark.parametrize("seed", range(25))
def test_streamed_chunks_equal_the_whole_parse(seed):
    rng = random.Random(1000 + seed)
    thinking = rng.random() < 0.5
    reasoning = random_text(rng, 30) if thinking else None
    calls = random_tool_calls(rng) if rng.random() < 0.7 else []
    text = completion_text(reasoning, random_text(rng, 30), calls)
    parser = CompletionParser(thinking=thinking, strict=True)
    reasoning_deltas, content_deltas, streamed_calls = [], [], []
    position = 0
    while position < len(text):
        size = rng.randint(1, 9)
        delta = parser.feed(text[position : position + size])
        position += size
        reasoning_deltas.append(delta.reasoning_content)
        content_deltas.append(delta.content)
        streamed_calls.extend(delta.tool_calls)
    final = parser.finish()
    whole = parse_completion(text, thinking=thinking, strict=True)
    assert "".join(reasoning_deltas) + final.reasoning_content == whole.reasoning_content
    assert "".join(content_deltas) + final.content == whole.content
    assert tuple(streamed_calls) + final.tool_calls == whole.tool_calls
    assert parser.is_done


def test_stream_emits_text_before_the_end_and_holds_back_partial_markers():
    parser = CompletionParser(thinking=True)
    first = parser.feed("Step one, step two</thi")
    assert first.reasoning_content == "Step one, step two"  # "</thi" may start </think>
    second = parser.feed("nk>Answer\n")
    assert (second.reasoning_content, second.content) == ("", "Answer")  # "\n" may start a block
    third = parser.feed("is 4.")
    assert third.content == "\nis 4."
    assert parser.finish() == ParsedCompletion()
    assert parser.result == ParsedCompletion(
        reasoning_content="Step one, step two", content="Answer\nis 4."
    )


def test_stream_emits_each_tool_call_when_its_invoke_closes():
    calls = [ToolCall("a", '{"x": 1}'), ToolCall("b", '{"y": "z"}')]
    text = completion_text(None, "", calls)
    first_end = text.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
    parser = CompletionParser(thinking=False, strict=True)
    assert parser.feed(text[: first_end - 1]).tool_calls == ()
    assert_same_calls(parser.feed(text[first_end - 1 : first_end]).tool_calls, calls[:1])
    assert_same_calls(parser.feed(text[first_end:]).tool_calls, calls[1:])


def test_stream_through_the_testing_tokenizer_decodes_split_characters():
    tokenizer = testing_tokenizer()
    calls = [ToolCall("weather", '{"city": "東京", "unit": "°C"}')]
    text = completion_text("考えています…", "Voilà: 東京 🌸", calls)
    parser = CompletionParser(thinking=True, strict=True)
    for piece in tokenizer.decode_stream(iter(tokenizer.encode(text, add_bos=False))):
        parser.feed(piece)
    parser.finish()
    assert parser.result == parse_completion(text, thinking=True, strict=True)
    assert parser.result.content == "Voilà: 東京 🌸"


@pytest.mark.parametrize(
    ("text", "thinking", "message"),
    [
        ("no end of reasoning", True, "missing </think>"),
        ("cut short" + EOS, True, "missing </think>"),
        ("hi" + EOS + "more", False, "after the end"),
        ("hi<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>", False, "blank line"),
        ('x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n', False, "missing"),
        (
            'x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="n" string="false">not json</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            False,
            "not valid JSON",
        ),
        (
            'x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="n" string="true">1</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="true">2</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            False,
            "duplicate",
        ),
        ("x\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>trailing", False, "after the tool-call"),
        ("a<think>b" + EOS, False, "special token"),
    ],
)
def test_strict_parse_rejects_off_format_text(text, thinking, message):
    with pytest.raises(ChatFormatError, match=message):
        parse_completion(text, thinking=thinking, strict=True)


def test_lenient_parse_recovers_what_it_can():
    assert parse_completion("cut off mid-thought", thinking=True) == ParsedCompletion(
        reasoning_content="cut off mid-thought"
    )
    assert parse_completion("hi" + EOS + "ignored", thinking=False).content == "hi"
    good = ToolCall("ok", '{"v": 1}')
    truncated = completion_text(None, "c", [good])[: -len("</｜DSML｜tool_calls>" + EOS)]
    truncated += '<｜DSML｜invoke name="cut">\n<｜DSML｜param'
    parsed = parse_completion(truncated, thinking=False)
    assert parsed.content == "c"
    assert_same_calls(parsed.tool_calls, [good])
    bad_json = completion_text(None, "", [good]).replace(">1<", ">oops<")
    assert parse_completion(bad_json, thinking=False).tool_calls[0].arguments_dict() == {
        "v": "oops"
    }
    trailing = completion_text(None, "c", [good]).replace(EOS, "tail" + EOS)
    assert parse_completion(trailing, thinking=False).content == "ctail"


def test_tool_calls_without_closing_the_reasoning():
    calls = [ToolCall("f", '{"q": "x"}')]
    text = "thinking" + completion_text(None, "", calls)
    parsed = parse_completion(text, thinking=True)
    assert parsed.reasoning_content == "thinking"
    assert_same_calls(parsed.tool_calls, calls)
    with pytest.raises(ChatFormatError, match="missing </think>"):
        parse_completion(text, thinking=True, strict=True)
