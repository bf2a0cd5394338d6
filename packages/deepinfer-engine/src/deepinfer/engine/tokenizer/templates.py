"""Fixed prompt texts of the DeepSeek-V4 chat format (``encoding_dsv4``).

These strings are part of the model's input format: the model was trained on them, so they
must match byte for byte. They are reproduced from DeepSeek's published encoder
(spec deepseek-v4.md section 5, source S15) and must not be reworded.
"""

from __future__ import annotations

from deepinfer.engine.tokenizer.special_tokens import DSML_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN

REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
"""Prepended to the first message in thinking mode when ``reasoning_effort="max"``."""

RESPONSE_FORMAT_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
"""Followed by the JSON schema of a message's ``response_format``."""

_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 (the format text has long lines; do not rewrap it)


def render_tools_section(tool_schema_lines: list[str]) -> str:
    """The "## Tools" section: DSML usage instructions then one JSON schema per line."""
    return _TOOLS_TEMPLATE.format(
        dsml=DSML_TOKEN,
        think_start=THINK_START_TOKEN,
        think_end=THINK_END_TOKEN,
        tool_schemas="\n".join(tool_schema_lines),
    )
