"""``deepinfer info --model DIR``: the checkpoint's KV cache formats, bytes per token and per
sequence against bf16, and a capacity, from the config alone (no weights read)."""

from __future__ import annotations

import json

from deepinfer.engine.cli import build_parser
from deepinfer.engine.cli.info import model_report

from ..model.test_config import V4_FLASH  # noqa: TID252


def test_info_model_reports_the_cache_formats_and_capacity(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    assert build_parser().parse_args(["info", "--model", str(tmp_path)]).model == str(tmp_path)
    out = model_report(str(tmp_path))
    assert "window KV: FP8 e4m3 x448 (ue8m0 scale / 64) + bfloat16 x64: 592 B/row" in out
    assert "indexer keys: FP4 e2m1 x128 (ue8m0 scale / 32): 80 B/row" in out
    assert "per token: 3620.5 B (0.53x of 6880 B in bfloat16)" in out
    assert "capacity (cpu" in out and " sequences" in out.split("capacity (cpu")[1]
