"""Image inputs of V4.1 on the CPU: decode (Pillow), resize plan, pad, normalise, patchify.

Decoding happens when a call is validated (every image of the call at once on the worker
threads), so an undecodable image fails its request before any work; the resize / pad /
normalise / patchify that follow run on the workers while the engine steps, and the model
runner waits for an image's patches only when the prefill chunk holding its span is scheduled.

Preprocessing follows the checkpoint's image processor (spec deepseek-v4.md section 7.4): the
image is converted to RGB, scaled to fit the planned box (:func:`plan_image`) with its aspect
kept (bicubic), centred on a gray (127) canvas of the box (an image wider than ``max_wh_ratio``
is squeezed into the box instead), scaled to ``[-1, 1]`` (``(x / 255 - 0.5) / 0.5``) and cut
into ``p x p`` patches, row-major, each flattened channel-major ``(c, dy, dx)``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.model.vision_config import ImagePlan, VisionConfig, fitted_size, plan_image

PAD_VALUE = 127


class ImageError(ValueError):
    """An image that cannot be used (undecodable, empty, unreachable)."""


def _open_bytes(data: bytes) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:  # Pillow raises several types for bad data
        raise ImageError(f"cannot decode the image data ({type(e).__name__}: {e})") from None
    return image


def _from_url(url: str) -> Any:
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ImageError(f"data URL {header[:40]!r}...: expected a ';base64' payload")
        try:
            return _open_bytes(base64.b64decode(payload, validate=True))
        except binascii.Error as e:
            raise ImageError(f"data URL: the base64 payload does not decode ({e})") from None
    if url.startswith(("http://", "https://")):
        raise ImageError(
            f"{url[:60]!r}: remote URLs are not fetched; give the image, its bytes, a file:// "
            "or a data: URL"
        )
    path = url.removeprefix("file://")
    if not os.path.isfile(path):
        raise ImageError(f"{url[:200]!r}: no such image file")
    with open(path, "rb") as f:
        return _open_bytes(f.read())


def decode_image(item: Any) -> Any:
    """A decoded RGB ``PIL.Image`` from a ``PIL.Image``, encoded bytes, a path, a
    ``file://`` URL or a ``data:image/...;base64,`` URL. Raises :class:`ImageError`."""
    from PIL import Image

    if isinstance(item, Image.Image):
        try:
            item.load()
        except Exception as e:
            raise ImageError(f"cannot decode the image ({type(e).__name__}: {e})") from None
        image = item
    elif isinstance(item, (bytes, bytearray, memoryview)):
        image = _open_bytes(bytes(item))
    elif isinstance(item, (str, os.PathLike)):
        image = _from_url(os.fspath(item))
    else:
        raise ImageError(
            f"got {type(item).__name__}; expected a PIL.Image, encoded bytes, a path, a "
            "file:// URL or a data: URL"
        )
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"the image is {width}x{height} pixels; expected both sides > 0")
    return image if image.mode == "RGB" else image.convert("RGB")


def preprocess(image: Any, plan: ImagePlan, config: VisionConfig) -> Any:
    """Patches ``[vit_h * vit_w, 3 p p]`` float32 (numpy) of a decoded RGB image."""
    import numpy as np
    from PIL import Image

    width, height = image.size
    squeeze = config.max_wh_ratio is not None and width >= config.max_wh_ratio * height
    if squeeze:
        canvas = np.asarray(image.resize((plan.width, plan.height), Image.Resampling.BICUBIC))
    else:
        fit_h, fit_w = fitted_size(height, width, plan.height, plan.width)
        resized = np.asarray(image.resize((fit_w, fit_h), Image.Resampling.BICUBIC))
        canvas = np.full((plan.height, plan.width, 3), PAD_VALUE, dtype=np.uint8)
        top, left = round((plan.height - fit_h) * 0.5), round((plan.width - fit_w) * 0.5)
        canvas[top : top + fit_h, left : left + fit_w] = resized
    x = (canvas.astype(np.float32) * np.float32(1 / 255) - np.float32(0.5)) / np.float32(0.5)
    p = config.patch_size
    x = x.reshape(plan.vit_h, p, plan.vit_w, p, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(plan.num_patches, 3 * p * p))


@dataclass(eq=False)
class ImageInput:
    """One image of a request: its plan, where its span starts in the prompt, and its patches
    (a future of the worker thread). Plain data for the scheduler, which only reads
    ``offset`` and ``num_tokens``."""

    plan: ImagePlan
    offset: int
    future: Future

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    def patches(self) -> Any:
        """``[vit_h * vit_w, 3 p p]`` float32 numpy; waits for the worker if needed."""
        return self.future.result()

    def __reduce__(self) -> tuple:
        """Pickled (to a data-parallel rank's worker) with its patches, waited for: a future
        does not cross processes."""
        return (_resolved, (self.plan, self.offset, self.patches()))


def _resolved(plan: ImagePlan, offset: int, patches: Any) -> ImageInput:
    """An :class:`ImageInput` whose patches are already there (unpickling)."""
    future: Future = Future()
    future.set_result(patches)
    return ImageInput(plan, offset, future)


class ImageProcessor:
    """Plans images and preprocesses them on a small thread pool (Pillow's resize and numpy
    release the GIL, so the work overlaps the engine's steps)."""

    def __init__(self, config: VisionConfig, max_workers: int = 2) -> None:
        self.config = config
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None

    def decode(self, item: Any) -> Future:
        """:func:`decode_image` of ``item`` on the pool (the future raises its ImageError)."""
        return self._workers().submit(decode_image, item)

    def plan(self, image: Any) -> ImagePlan:
        width, height = image.size
        return plan_image(width, height, self.config)

    def submit(self, image: Any, plan: ImagePlan, offset: int) -> ImageInput:
        future = self._workers().submit(preprocess, image, plan, self.config)
        return ImageInput(plan, offset, future)

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="deepinfer-img")
        return self._pool
