"""DSML, the markup V4 uses for tool calls (spec deepseek-v4.md section 5).

A tool-call block, as the assistant writes it after its content and a blank line::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String argument values are written raw with ``string="true"``; every other JSON value is
written as JSON with ``string="false"``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from deepinfer.engine.tokenizer.chat_types import ChatFormatError, ToolCall, to_json
from deepinfer.engine.tokenizer.special_tokens import DSML_TOKEN

TOOL_CALLS_START = f"<{DSML_TOKEN}tool_calls>"
TOOL_CALLS_END = f"</{DSML_TOKEN}tool_calls>"
INVOKE_END = f"</{DSML_TOKEN}invoke>"
TOOL_CALLS_SEPARATOR = "\n\n"
"""Between the assistant's content and its tool-call block."""

_INVOKE = re.compile(
    rf'<{DSML_TOKEN}invoke name="(?P<name>[^"\n]*)">\n(?P<body>.*?){re.escape(INVOKE_END)}',
    re.DOTALL,
)
_PARAMETER = re.compile(
    rf'<{DSML_TOKEN}parameter name="(?P<name>[^"\n]*)" string="(?P<is_string>true|false)">'
    rf"(?P<value>.*?)</{DSML_TOKEN}parameter>",
    re.DOTALL,
)


def _render_parameter(name: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    flag = "true" if is_string else "false"
    return f'<{DSML_TOKEN}parameter name="{name}" string="{flag}">{text}</{DSML_TOKEN}parameter>'


def render_tool_calls(tool_calls: Sequence[ToolCall]) -> str:
    """The ``<｜DSML｜tool_calls>`` block for ``tool_calls`` (without the leading blank line)."""
    invokes = []
    for call in tool_calls:
        parameters = "\n".join(
            _render_parameter(name, value) for name, value in call.arguments_dict().items()
        )
        invokes.append(f'<{DSML_TOKEN}invoke name="{call.name}">\n{parameters}\n{INVOKE_END}')
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _decode_value(name: str, value: str, is_string: str, *, strict: bool) -> Any:
    if is_string == "true":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if strict:
            raise ChatFormatError(
                f'DSML parameter {name!r}: string="false" value {value!r} is not valid JSON'
            ) from None
        return value


def parse_invoke(text: str, *, strict: bool = True) -> ToolCall:
    """One complete ``<｜DSML｜invoke ...>...</｜DSML｜invoke>`` element -> ``ToolCall``.

    ``arguments`` is re-serialised JSON (same values, V4's separators). With ``strict``, any
    stray text between parameters, a duplicate parameter or a non-JSON ``string="false"``
    value raises ``ChatFormatError``; without it, such text is ignored (a bad JSON value is
    kept as a string).
    """
    match = _INVOKE.fullmatch(text.strip("\n"))
    if match is None:
        raise ChatFormatError(f"malformed DSML invoke element: {text[:120]!r}")
    arguments: dict[str, Any] = {}
    position, body = 0, match["body"]
    for parameter in _PARAMETER.finditer(body):
        gap = body[position : parameter.start()]
        if strict and gap.strip("\n"):
            raise ChatFormatError(f"unexpected text {gap!r} in DSML invoke {match['name']!r}")
        name = parameter["name"]
        if strict and name in arguments:
            raise ChatFormatError(f"duplicate DSML parameter {name!r} in {match['name']!r}")
        arguments[name] = _decode_value(
            name, parameter["value"], parameter["is_string"], strict=strict
        )
        position = parameter.end()
    if strict and body[position:].strip("\n"):
        raise ChatFormatError(f"unexpected text {body[position:]!r} in DSML invoke")
    return ToolCall(name=match["name"], arguments=to_json(arguments))


def split_invokes(block_body: str) -> list[str]:
    """The invoke elements of a tool-call block's body, in order (text between them dropped)."""
    return [match.group(0) for match in _INVOKE.finditer(block_body)]
