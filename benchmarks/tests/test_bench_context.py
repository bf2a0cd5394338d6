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
    one, four = counted(config, [4096], [1, 4])
    assert one["recv_gb_hidden_gather"] == one["recv_gb_keys_only"] == 0
    assert four["recv_gb_hidden_gather"] > four["recv_gb_keys_only"] > 0
    assert four["repeated_key_tflops"] == one["repeated_key_tflops"] > 0
    repeated = one["repeated_key_tflops"]
    own_share = (four["linear_tflops_max"] - repeated) / (one["linear_tflops_max"] - repeated)
    assert own_share == pytest.approx(0.25, abs=0.01)
    assert four["attention_tflops_max"] <= 0.27 * one["attention_tflops_max"]
    assert four["peak_ratio_to_cp1"] < 1.0
    assert peak_activation_bytes(config, 1024, 4096, 4) == pytest.approx(
        four["peak_activation_gb"] * 1e9, rel=1e-9
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
