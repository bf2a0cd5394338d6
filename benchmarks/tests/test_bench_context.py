"""The context-parallel benchmark's arithmetic: counted per-rank work divides by CP where it
should (own rows) and not where every rank repeats it (key projections), the exchange is zero
at CP = 1, and the peak fit recovers a known quadratic."""

from __future__ import annotations

import pytest

from benchmarks.parallel.bench_context import counted, peak_activation_bytes, peak_fit
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config


@pytest.mark.parametrize("raw", [tiny_v4_config(), tiny_v41_config(vision=False)])
def test_counted_work_splits_over_the_ranks(raw) -> None:
    config = parse_config(raw)
    one, four = counted(config, [32768], [1, 4])
    assert one["hidden"]["recv_gb"] == one["borders"]["recv_gb"] == 0
    hidden, borders = four["hidden"], four["borders"]
    assert hidden["recv_gb"] > borders["recv_gb"] > 0
    # hidden: every rank computes keys for every row; borders: for its own and a few more
    assert hidden["key_rows_max"] == one["borders"]["key_rows_max"] == 32768
    assert 8192 < borders["key_rows_max"] < 16384
    assert borders["key_linear_tflops_max"] < 0.5 * hidden["key_linear_tflops_max"]
    assert four["own_linear_tflops_max"] == pytest.approx(one["own_linear_tflops_max"] / 4)
    assert four["attention_tflops_max"] <= 0.27 * one["attention_tflops_max"]
    assert borders["peak_ratio_to_cp1"] < hidden["peak_ratio_to_cp1"] < 1.0
    assert peak_activation_bytes(config, 8192, 32768, 4) == pytest.approx(
        hidden["peak_activation_gb"] * 1e9, rel=1e-9
    )


def test_peak_fit_recovers_a_quadratic() -> None:
    rows = [
        {"tokens": n, "cp": cp, "peak_mb_max": 5 + 0.01 * n + 1e-6 * n * n / cp}
        for n in (1000, 2000, 4000)
        for cp in (1, 4)
    ]
    fit = peak_fit(rows, [8000])
    assert fit["projected_peak_mb"][1][8000] == pytest.approx(5 + 80 + 64, rel=1e-6)
    expected = (5 + 80 + 16) / (5 + 80 + 64)
    assert fit["ratio_to_cp1"][4][8000] == pytest.approx(expected, rel=1e-6)
