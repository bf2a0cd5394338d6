"""A checkpoint's ``preprocessor_config.json`` must describe the preprocessing we implement."""

import json

import pytest

from deepinfer.engine.checkpoint.index import CheckpointError
from deepinfer.engine.checkpoint.inventory_vision import check_image_processor
from deepinfer.engine.model.vision_config import VisionConfig

RELEASED = VisionConfig(
    num_layers=32, hidden_size=1024, num_heads=16, intermediate_size=2816, patch_size=14
)
# the transformers processor's defaults, as its save_pretrained writes them
PORT_FORM = {
    "image_processor_type": "DeepseekV41ImageProcessor",
    "do_resize": True, "resample": 3, "size": {"shortest_edge": 295936, "longest_edge": 1024},
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    "patch_size": 14, "downsample_ratio": 3, "max_wh_ratio": None, "pad_value": 127,
}  # fmt: skip


def _write(tmp_path, **changes):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PORT_FORM, **changes}))


def test_the_port_form_and_no_file_pass(tmp_path):
    check_image_processor(tmp_path, RELEASED)  # no file: nothing to check
    _write(tmp_path)
    check_image_processor(tmp_path, RELEASED)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"image_mean": [0.48, 0.46, 0.41]}, "image_mean"),
        ({"patch_size": 16}, "patch_size"),
        ({"size": {"shortest_edge": 200704, "longest_edge": 1024}}, "min_pixels"),
        ({"max_image_tokens": 2048}, "max_image_tokens"),
        ({"resample": 2}, "resample"),
    ],
)
def test_a_different_preprocessing_is_refused_naming_the_field(tmp_path, changes, field):
    _write(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=f"preprocessor_config.json: {field}="):
        check_image_processor(tmp_path, RELEASED)
