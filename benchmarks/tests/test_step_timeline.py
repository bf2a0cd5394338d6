"""The step timeline's device arithmetic: busy time is the union of kernel intervals, idle
gaps are what lies between them."""

from __future__ import annotations

import pytest

from benchmarks.engine.step_timeline import device_gaps


def test_busy_is_the_union_of_overlapping_kernels_and_gaps_the_rest() -> None:
    kernels = [(10.0, 20.0), (15.0, 30.0), (30.0, 31.0), (40.0, 50.0), (45.0, 46.0), (100.0, 101.0)]
    timeline = device_gaps(list(reversed(kernels)))
    assert timeline["window_us"] == 91.0
    assert timeline["busy_us"] == pytest.approx(21.0 + 10.0 + 1.0)
    assert timeline["gaps"] == [9.0, 50.0]
    assert timeline["busy_us"] + sum(timeline["gaps"]) == timeline["window_us"]
    assert device_gaps([]) == {"window_us": 0.0, "busy_us": 0.0, "gaps": []}
