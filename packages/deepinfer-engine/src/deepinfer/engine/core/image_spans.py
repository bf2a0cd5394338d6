"""Prefill chunks never end inside an image span: the model reads a span's embeddings from
one vision-tower run, in the step that prefills the whole span (spec deepseek-v4.md 7.4)."""

from __future__ import annotations

from typing import Any


def fit_to_image_spans(request: Any, num_new: int) -> int:
    """``num_new`` cut back so the chunk starting at ``request.num_computed_tokens`` does not
    end inside one of ``request.images``' spans (``.offset``, ``.num_tokens``): the chunk stops
    before the span, or is 0 when it starts at a span the budget cannot hold whole."""
    start = request.num_computed_tokens
    end = start + num_new
    for image in request.images:
        if image.offset < end < image.offset + image.num_tokens:
            return max(0, image.offset - start)
    return num_new
