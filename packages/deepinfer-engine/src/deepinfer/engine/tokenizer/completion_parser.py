"""Split an assistant completion into reasoning, content and tool calls, in one go or streamed.

The completion is the text generated after the prompt from ``encode_messages`` (decode it
with special tokens kept). Spec deepseek-v4.md section 5: in thinking mode the reasoning runs
up to ``</think>``; the content runs up to EOS or to a blank line followed by a
``<｜DSML｜tool_calls>`` block; the block is followed by EOS. A missing EOS at the very end is
accepted (the engine may have stripped the stop token).

``strict=True`` raises ``ChatFormatError`` on anything off-format (missing ``</think>``,
malformed DSML, text after EOS or after the tool calls, special tokens inside the content).
``strict=False`` (the default) never raises: reasoning cut off by the length limit stays
reasoning, text after the tool-call block is appended to the content, an unterminated or
malformed invoke is dropped, tool calls that start before ``</think>`` are still parsed,
and text after EOS is ignored.
"""

from __future__ import annotations

from deepinfer.engine.tokenizer.chat_types import ChatFormatError, ParsedCompletion, ToolCall
from deepinfer.engine.tokenizer.dsml import (
    INVOKE_END,
    TOOL_CALLS_END,
    TOOL_CALLS_SEPARATOR,
    TOOL_CALLS_START,
    parse_invoke,
)
from deepinfer.engine.tokenizer.special_tokens import (
    BOS_TOKEN,
    DSML_TOKEN,
    EOS_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
)

_TOOL_CALLS_OPENING = TOOL_CALLS_SEPARATOR + TOOL_CALLS_START
_FORBIDDEN_IN_TEXT = (BOS_TOKEN, EOS_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN, DSML_TOKEN)


def _partial_marker_length(buffer: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buffer`` that could start one of ``markers``."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:length]):
                longest = length
                break
    return longest


def _find_first(buffer: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest occurrence of any marker (the longest one on a tie), or (-1, None)."""
    best_position, best_marker = -1, None
    for marker in markers:
        position = buffer.find(marker)
        if position < 0:
            continue
        if (
            best_marker is None
            or position < best_position
            or (position == best_position and len(marker) > len(best_marker))
        ):
            best_position, best_marker = position, marker
    return best_position, best_marker


class CompletionParser:
    """Incremental parser: ``feed`` text deltas, then ``finish``; each returns the new pieces.

    Reasoning and content come out as soon as they cannot be the start of a marker; a tool
    call comes out whole when its ``</｜DSML｜invoke>`` arrives. ``result`` accumulates all.
    """

    def __init__(self, *, thinking: bool, strict: bool = False) -> None:
        self.strict = strict
        self._phase = "reasoning" if thinking else "content"
        self._buffer = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: list[ToolCall] = []

    @property
    def result(self) -> ParsedCompletion:
        """Everything parsed so far."""
        return ParsedCompletion(
            reasoning_content="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=tuple(self._tool_calls),
        )

    @property
    def is_done(self) -> bool:
        """True once the end of the message (EOS) has been seen."""
        return self._phase == "done"

    def feed(self, text: str) -> ParsedCompletion:
        """Consume ``text``; return the reasoning, content and tool calls it completed."""
        start = (len(self._reasoning), len(self._content), len(self._tool_calls))
        self._buffer += text
        while self._step():
            pass
        return self._delta_since(start)

    def finish(self) -> ParsedCompletion:
        """End of the completion: flush held-back text and check the format."""
        start = (len(self._reasoning), len(self._content), len(self._tool_calls))
        if self._phase == "reasoning":
            self._error("completion ended inside the reasoning: missing </think>")
            self._reasoning.append(self._buffer)
        elif self._phase == "content":
            self._content.append(self._buffer)
        elif self._phase == "tool_calls":
            self._error(f"completion ended inside the tool-call block: missing {TOOL_CALLS_END}")
        self._buffer, self._phase = "", "done"
        if self.strict:
            self._check_no_special_tokens()
        return self._delta_since(start)

    def _delta_since(self, start: tuple[int, int, int]) -> ParsedCompletion:
        return ParsedCompletion(
            reasoning_content="".join(self._reasoning[start[0] :]),
            content="".join(self._content[start[1] :]),
            tool_calls=tuple(self._tool_calls[start[2] :]),
        )

    def _error(self, message: str) -> None:
        if self.strict:
            raise ChatFormatError(message)

    def _emit_until(self, markers: tuple[str, ...], sink: list[str]) -> str | None:
        """Move text before the first marker into ``sink`` and drop the marker; return it.
        Without a marker, move what cannot start one and return None."""
        position, marker = _find_first(self._buffer, markers)
        if marker is None:
            keep = _partial_marker_length(self._buffer, markers)
            sink.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return None
        sink.append(self._buffer[:position])
        self._buffer = self._buffer[position + len(marker) :]
        return marker

    def _step(self) -> bool:
        """Advance one phase transition; False when more text is needed."""
        if self._phase == "reasoning":
            markers = (THINK_END_TOKEN, EOS_TOKEN, _TOOL_CALLS_OPENING)
            marker = self._emit_until(markers, self._reasoning)
            if marker in (EOS_TOKEN, _TOOL_CALLS_OPENING):
                self._error(f"{marker!r} inside the reasoning: missing </think>")
            if marker is not None:
                next_phases = {THINK_END_TOKEN: "content", EOS_TOKEN: "done"}
                self._phase = next_phases.get(marker, "tool_calls")
            return marker is not None
        if self._phase == "content":
            markers = (EOS_TOKEN, _TOOL_CALLS_OPENING, TOOL_CALLS_START)
            marker = self._emit_until(markers, self._content)
            if marker == TOOL_CALLS_START:
                self._error("tool-call block not preceded by a blank line")
            if marker is not None:
                self._phase = "done" if marker == EOS_TOKEN else "tool_calls"
            return marker is not None
        if self._phase == "tool_calls":
            return self._step_tool_calls()
        if self._phase == "after_tool_calls":
            return self._step_after_tool_calls()
        if self._buffer:  # phase "done"
            self._error(f"text after the end of the message: {self._buffer[:80]!r}")
            self._buffer = ""
        return False

    def _step_tool_calls(self) -> bool:
        position, marker = _find_first(self._buffer, (INVOKE_END, TOOL_CALLS_END))
        if marker is None:
            return False
        if marker == INVOKE_END:
            element = self._buffer[: position + len(marker)]
            self._buffer = self._buffer[position + len(marker) :]
            try:
                self._tool_calls.append(parse_invoke(element, strict=self.strict))
            except ChatFormatError:
                if self.strict:
                    raise
            return True
        if self._buffer[:position].strip("\n"):
            self._error(f"unexpected text in the tool-call block: {self._buffer[:position]!r}")
        self._buffer = self._buffer[position + len(marker) :]
        self._phase = "after_tool_calls"
        return True

    def _step_after_tool_calls(self) -> bool:
        if self._buffer.startswith(EOS_TOKEN):
            self._buffer = self._buffer[len(EOS_TOKEN) :]
            self._phase = "done"
            return True
        if not self._buffer or EOS_TOKEN.startswith(self._buffer):
            return False
        self._error(f"text after the tool-call block: {self._buffer[:80]!r}")
        self._phase = "content"  # lenient: keep it as content
        return True

    def _check_no_special_tokens(self) -> None:
        result = self.result
        for token in _FORBIDDEN_IN_TEXT:
            if token in result.content or token in result.reasoning_content:
                raise ChatFormatError(f"special token {token!r} inside the parsed text")


def parse_completion(text: str, *, thinking: bool, strict: bool = False) -> ParsedCompletion:
    """Parse a whole completion (see the module docstring for ``strict``)."""
    parser = CompletionParser(thinking=thinking, strict=strict)
    parser.feed(text)
    parser.finish()
    return parser.result
