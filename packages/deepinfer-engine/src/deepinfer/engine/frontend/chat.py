"""``LLM.chat`` helpers: V4 chat encoding of conversations and parsing of completions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer.engine.frontend.outputs import RequestOutput
from deepinfer.engine.frontend.validation import InvalidRequestError


def _image_of(index: int, part: Mapping[str, Any]) -> Any:
    if part.get("type") == "image":
        if "image" not in part:
            raise InvalidRequestError(f"request {index}: an 'image' content part has no 'image'")
        return part["image"]
    source = part.get("image_url")
    url = source.get("url") if isinstance(source, Mapping) else source
    if not isinstance(url, str):
        raise InvalidRequestError(
            f"request {index}: an 'image_url' content part needs {{'image_url': {{'url': str}}}}"
        )
    return url


def split_content_parts(
    index: int, messages: Sequence[Mapping[str, Any]]
) -> tuple[list[Mapping[str, Any]], list[Any]]:
    """(messages with list contents flattened to text, the images in order): each image part
    becomes the image placeholder token in the text (V4.1 expands it to the image's span)."""
    from deepinfer.engine.tokenizer.special_tokens import IMAGE_TOKEN

    flat, images = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            flat.append(message)
            continue
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind in ("image", "image_url"):
                images.append(_image_of(index, part))
                pieces.append(IMAGE_TOKEN)
            else:
                raise InvalidRequestError(
                    f"request {index}: content part {part!r}: expected type 'text', 'image_url' "
                    "or 'image'"
                )
        flat.append({**message, "content": "".join(pieces)})
    return flat, images


def encode_conversations(
    tokenizer: Any,
    conversations: Any,
    thinking: bool,
    reasoning_effort: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[str], list[list[int]], list[dict[str, Any]] | None]:
    """(prompt text, token ids, ``multi_modal_data`` or None) of each conversation
    (``conversations``: one or a list); None when no message has an image."""
    from deepinfer.engine.tokenizer import ChatFormatError

    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer; the engine has none")
    if not isinstance(conversations, Sequence) or isinstance(conversations, str):
        raise InvalidRequestError(
            f"conversations={conversations!r}: expected a list of messages or a list of them"
        )
    if conversations and isinstance(conversations[0], Mapping):
        conversations = [conversations]
    token_ids, images = [], []
    for index, messages in enumerate(conversations):
        messages, message_images = split_content_parts(index, messages)
        try:
            ids = tokenizer.encode_chat(
                messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools
            )
        except (ChatFormatError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"request {index}: {e}") from e
        token_ids.append(ids)
        images.append({"image": message_images})
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in token_ids]
    return texts, token_ids, (images if any(d["image"] for d in images) else None)


def parse_outputs(outputs: list[RequestOutput], thinking: bool) -> None:
    """Fill ``reasoning_content``, ``content`` and ``tool_calls`` of every sample in place."""
    from deepinfer.engine.tokenizer import parse_completion

    for output in outputs:
        for sample in output.outputs:
            parsed = parse_completion(sample.text, thinking=thinking)
            sample.reasoning_content = parsed.reasoning_content
            sample.content = parsed.content
            sample.tool_calls = list(parsed.tool_calls)


class ChatStreamParser:
    """Parses streamed chat deltas incrementally, one parser per (request, sample)."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self._parsers: dict[tuple[str, int], Any] = {}

    def annotate(self, delta: RequestOutput) -> RequestOutput:
        """Fill each sample's ``reasoning_content`` / ``content`` / ``tool_calls`` with what
        its new text completed (the rest is flushed when the sample finishes)."""
        from deepinfer.engine.tokenizer import CompletionParser

        for sample in delta.outputs:
            key = (delta.request_id, sample.index)
            parser = self._parsers.get(key)
            if parser is None:
                parser = self._parsers[key] = CompletionParser(thinking=self.thinking)
            parsed = parser.feed(sample.text)
            if sample.finished:
                tail = parser.finish()
                parsed = type(parsed)(
                    reasoning_content=parsed.reasoning_content + tail.reasoning_content,
                    content=parsed.content + tail.content,
                    tool_calls=parsed.tool_calls + tail.tool_calls,
                )
                del self._parsers[key]
            sample.reasoning_content = parsed.reasoning_content
            sample.content = parsed.content
            sample.tool_calls = list(parsed.tool_calls)
        return delta
