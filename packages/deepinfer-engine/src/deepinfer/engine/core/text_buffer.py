"""Growing output text with appends, tail reads and truncation in time proportional to the
change, not to the text length (outputs can run to hundreds of thousands of characters)."""

from __future__ import annotations


class TextBuffer:
    """Text kept as a list of chunks; ``length`` is the total number of characters."""

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self.length = 0

    def append(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self.length += len(text)

    def tail(self, num_chars: int) -> str:
        """The last ``num_chars`` characters (all of them if fewer)."""
        if num_chars <= 0:
            return ""
        if self._chunks and len(self._chunks[-1]) >= num_chars:  # the usual one-token tail
            return self._chunks[-1][-num_chars:]
        parts, collected = [], 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            collected += len(chunk)
            if collected >= num_chars:
                break
        return "".join(reversed(parts))[-num_chars:]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` characters."""
        while self._chunks and self.length - len(self._chunks[-1]) >= length:
            self.length -= len(self._chunks.pop())
        if self.length > length:
            last = self._chunks[-1]
            self._chunks[-1] = last[: len(last) - (self.length - length)]
            self.length = length

    def text(self) -> str:
        """The whole text (joins the chunks once; later calls reuse the join)."""
        joined = "".join(self._chunks)
        self._chunks = [joined] if joined else []
        return joined
