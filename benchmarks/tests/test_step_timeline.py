"""The step timeline's device arithmetic: busy time is the union of kernel intervals, idle
gaps are what lies between them."""

from __future__ import annotations

import pytest

from benchmarks.engine.step_timeline import device_gaps, gap_sites


def test_busy_is_the_union_of_overlapping_kernels_and_gaps_the_rest() -> None:
    kernels = [(10.0, 20.0), (15.0, 30.0), (30.0, 31.0), (40.0, 50.0), (45.0, 46.0), (100.0, 101.0)]
    timeline = device_gaps(list(reversed(kernels)))
    assert timeline["window_us"] == 91.0
    assert timeline["busy_us"] == pytest.approx(21.0 + 10.0 + 1.0)
    assert timeline["gaps"] == [9.0, 50.0]
    assert timeline["busy_us"] + sum(timeline["gaps"]) == timeline["window_us"]
    assert device_gaps([]) == {"window_us": 0.0, "busy_us": 0.0, "gaps": []}


def test_gap_sites_group_the_long_gaps_by_the_kernels_around_them() -> None:
    kernels = [
        (0.0, 10.0, "graph_end"), (110.0, 120.0, "copy_in"), (125.0, 130.0, "gemm"),
        (130.0, 200.0, "moe"), (150.0, 160.0, "inside_moe"), (300.0, 310.0, "graph_end"),
        (360.0, 370.0, "copy_in"),
    ]  # fmt: skip
    sites = gap_sites(list(reversed(kernels)), steps=2)
    # 100 and 50 us after graph_end, 100 us after moe (the kernel that ends last), 5 us ignored
    assert sites == [
        {"before": "graph_end", "after": "copy_in", "per_step": 1.0, "ms_per_step": 0.075},
        {"before": "moe", "after": "graph_end", "per_step": 0.5, "ms_per_step": 0.05},
    ]
    assert gap_sites([], steps=1) == []
