"""Prompts with images: ``{"prompt" | "prompt_token_ids": ..., "multi_modal_data": {"image":
...}}``, one image placeholder token per image, each expanded to the image's span.

:func:`split_prompt_dicts` takes the dict form apart (a malformed structure fails the call);
:meth:`ImageRequests.prepare` checks one request's images against its placeholders and the
engine's limits and returns either the expanded prompt with its :class:`ImageInput` list or
the message its request fails alone with (before any work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from deepinfer.engine.frontend.images import ImageError, ImageInput, ImageProcessor, decode_image
from deepinfer.engine.frontend.validation import InvalidRequestError
from deepinfer.engine.model.vision_config import ImageSettings

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def _images_of(index: int, data: Any) -> list[Any]:
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise InvalidRequestError(
            f"request {index}: multi_modal_data is {type(data).__name__}, expected a dict "
            "like {'image': PIL.Image or a list of them}"
        )
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidRequestError(
            f"request {index}: multi_modal_data has {unknown}; only 'image' is supported"
        )
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _per_request(multi_modal_data: Any, num_requests: int) -> list[list[Any]]:
    if multi_modal_data is None:
        return [[] for _ in range(num_requests)]
    if isinstance(multi_modal_data, Mapping):
        multi_modal_data = [multi_modal_data]
    data = list(multi_modal_data)
    if len(data) != num_requests:
        raise InvalidRequestError(
            f"{num_requests} prompts but {len(data)} multi_modal_data entries; give one per prompt"
        )
    return [_images_of(index, d) for index, d in enumerate(data)]


def split_prompt_dicts(
    prompts: Any, prompt_token_ids: Any, multi_modal_data: Any = None
) -> tuple[Any, Any, list[list[Any]] | None]:
    """(prompts, prompt_token_ids, images per request or None) from ``generate``'s arguments:
    dict prompts give their text or token ids and their ``multi_modal_data``; else
    ``multi_modal_data`` is one dict per prompt (or one dict for a single prompt)."""
    items = [prompts] if isinstance(prompts, Mapping) else prompts
    dicts = isinstance(items, Sequence) and any(isinstance(p, Mapping) for p in items)
    if not dicts:
        if multi_modal_data is None:
            return prompts, prompt_token_ids, None
        source = prompt_token_ids if prompt_token_ids is not None else prompts
        if isinstance(source, str) or (
            source is prompt_token_ids and source and not isinstance(source[0], Sequence)
        ):
            source = [source]
        return prompts, prompt_token_ids, _per_request(multi_modal_data, len(source or []))
    if prompt_token_ids is not None or multi_modal_data is not None:
        raise InvalidRequestError(
            "dict prompts carry their own token ids and images; give no prompt_token_ids or "
            "multi_modal_data with them"
        )
    texts, ids, images = [], [], []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            item = {"prompt": item}
        unknown = sorted(set(item) - _PROMPT_KEYS)
        if unknown or ("prompt" in item) == ("prompt_token_ids" in item):
            raise InvalidRequestError(
                f"request {index}: a dict prompt needs exactly one of 'prompt' or "
                f"'prompt_token_ids' (and optionally 'multi_modal_data'); got keys {sorted(item)}"
            )
        texts.append(item.get("prompt"))
        ids.append(item.get("prompt_token_ids"))
        images.append(_images_of(index, item.get("multi_modal_data")))
    if all(t is not None for t in texts):
        return texts, None, images
    if all(i is not None for i in ids):
        return None, ids, images
    raise InvalidRequestError(
        "give every dict prompt as 'prompt' or every one as 'prompt_token_ids'"
    )


class ImageRequests:
    """Per-request image checks and placeholder expansion for one engine."""

    def __init__(
        self, settings: ImageSettings | None, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        self.settings = settings
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.processor = ImageProcessor(settings.config) if settings is not None else None

    def prepare_all(
        self, token_ids: list[list[int]], images: list[list[Any]] | None
    ) -> tuple[list[list[int]], list[tuple[ImageInput, ...]], list[str | None]]:
        """:meth:`prepare` over a call: (prompts, images, error or None) per request."""
        images = images if images is not None else [[] for _ in token_ids]
        if len(images) != len(token_ids):
            raise InvalidRequestError(
                f"{len(token_ids)} prompts but images for {len(images)}; give one entry each"
            )
        if self.processor is not None:  # decode every image of the call on the pool at once
            images = [[self.processor.decode(item) for item in imgs] for imgs in images]
        prepared = [
            self.prepare(i, ids, imgs) for i, (ids, imgs) in enumerate(zip(token_ids, images))
        ]
        return [p[0] for p in prepared], [p[1] for p in prepared], [p[2] for p in prepared]

    def prepare(
        self, index: int, token_ids: list[int], images: Sequence[Any]
    ) -> tuple[list[int], tuple[ImageInput, ...], str | None]:
        """(prompt with every placeholder expanded, its images, None) or
        (``token_ids``, (), the message the request fails with)."""
        if not images and self.settings is None:
            return token_ids, (), None
        if self.settings is None:
            return (
                token_ids,
                (),
                (
                    f"request {index}: it has {len(images)} image(s) but the model has no vision "
                    "tower (its config.json has no vision_config)"
                ),
            )
        image_id = self.settings.image_token_id
        placeholders = [k for k, t in enumerate(token_ids) if t == image_id]
        if not placeholders and not images:
            return token_ids, (), None
        if len(placeholders) != len(images):
            return (
                token_ids,
                (),
                (
                    f"request {index}: the prompt has {len(placeholders)} image placeholder(s) "
                    f"(token id {image_id}) but {len(images)} image(s) were given; expected one "
                    "placeholder per image"
                ),
            )
        decoded, plans = [], []
        for k, item in enumerate(images):
            try:
                image = item.result() if isinstance(item, Future) else decode_image(item)
                plans.append(self.processor.plan(image))
            except (ImageError, ValueError) as e:
                return token_ids, (), f"request {index}: image {k}: {e}"
            decoded.append(image)
        return self._expand(index, token_ids, placeholders, decoded, plans)

    def _expand(self, index, token_ids, placeholders, decoded, plans):
        image_id = self.settings.image_token_id
        expanded: list[int] = []
        offsets = []
        previous = 0
        for k, position in enumerate(placeholders):
            expanded += token_ids[previous:position]
            offsets.append(len(expanded))
            expanded += [image_id] * plans[k].num_tokens
            previous = position + 1
        expanded += token_ids[previous:]
        sizes = ", ".join(str(p.num_tokens) for p in plans)
        if len(expanded) >= self.max_model_len:
            return (
                token_ids,
                (),
                (
                    f"request {index}: the prompt has {len(expanded)} tokens with its images "
                    f"expanded (image spans: {sizes}), expected fewer than max_model_len="
                    f"{self.max_model_len}"
                ),
            )
        longest = max(p.num_tokens for p in plans)
        if longest > self.max_num_batched_tokens:
            return (
                token_ids,
                (),
                (
                    f"request {index}: an image span of {longest} tokens must be prefilled in one "
                    f"step, but max_num_batched_tokens={self.max_num_batched_tokens}"
                ),
            )
        inputs = tuple(
            self.processor.submit(image, plan, offset)
            for image, plan, offset in zip(decoded, plans, offsets)
        )
        return expanded, inputs, None
