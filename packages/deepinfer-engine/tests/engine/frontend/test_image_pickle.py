"""An image input crosses to a data-parallel rank's worker (pickled) with its patches."""

from __future__ import annotations

import pickle

import numpy as np
from PIL import Image

from deepinfer.engine.frontend.images import ImageProcessor
from deepinfer.engine.model.vision_config import VisionConfig
from deepinfer.engine.testing.vision_configs import tiny_vision_config


def test_an_image_input_pickles_with_its_patches():
    processor = ImageProcessor(VisionConfig.from_raw(tiny_vision_config()))
    pixels = np.random.default_rng(2).integers(0, 256, (9, 14, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    sent = processor.submit(image, processor.plan(image), offset=3)
    received = pickle.loads(pickle.dumps(sent))
    assert (received.plan, received.offset) == (sent.plan, 3)
    assert received.patches().std() > 0
    np.testing.assert_array_equal(received.patches(), sent.patches())
