"""The step's image spans as model inputs: each image's patches go through the vision tower
once, in the step that prefills its span (the frontend preprocessed them on a worker thread;
this waits for it only if it is still running)."""

from __future__ import annotations

from typing import Any

import torch


def image_fields(model: torch.nn.Module, images: list[tuple[int, Any]], device) -> dict:
    """``ForwardBatch`` fields ``image_rows [N]`` / ``image_embeds [N, D]`` for ``images``
    (``(first row, ImageInput)`` of each span in the step); ``{}`` when there are none."""
    if not images:
        return {}
    rows, embeds = [], []
    for first_row, image in images:
        plan = image.plan
        patches = torch.from_numpy(image.patches()).to(device, non_blocking=True)
        span = model.encode_image(patches, plan.vit_h, plan.vit_w)
        rows.append(torch.arange(first_row, first_row + span.shape[0], device=device))
        embeds.append(span)
    return {"image_rows": torch.cat(rows), "image_embeds": torch.cat(embeds)}
