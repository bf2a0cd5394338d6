"""The op counter counts the torch ops a step issues outside the kernels ops, by source line,
and ``op_work`` counts what ``apply_rope`` moves in place as its rotary channels only."""

from __future__ import annotations

import torch

from benchmarks.engine import prefill_op_count
from benchmarks.engine.op_work import OpRecorder
from benchmarks.sweep.roofline import H200


def test_rope_in_place_is_counted_as_its_rotary_channels() -> None:
    from deepinfer.kernels import ops

    x = torch.randn(6, 4, 96)
    angles = torch.rand(6, 16)
    cos, sin = angles.cos(), angles.sin()
    recorder = OpRecorder(H200)
    with recorder.active():
        ops.apply_rope(x, cos, sin)
    out_of_place = recorder.work["apply_rope"].bytes
    assert out_of_place == 2 * x.numel() * 4 + 2 * cos.numel() * 4
    recorder = OpRecorder(H200)
    with recorder.active():
        ops.apply_rope(x, cos, sin, out=x)
    assert recorder.work["apply_rope"].bytes == 2 * 6 * 4 * 32 * 4 + 2 * cos.numel() * 4


def test_outside_ops_skip_op_internals_and_name_our_lines() -> None:
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.kernels import ops

    x, weight = torch.randn(5, 8), torch.rand(8) + 0.5
    recorder = OpRecorder(H200)
    with recorder.active(), profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        y = ops.rms_norm(x, weight, 1e-6)  # its internals belong to the op
        torch.where(y > 0, y, 0.0)  # ours, from this file (not under deepinfer/: no line)
    found = prefill_op_count.outside_ops(prof.events())
    names = [name for name, _, _ in found]
    assert "aten::where" in names and "aten::pow" not in names and "aten::mean" not in names
    assert not any(in_layer for *_, in_layer in found)
