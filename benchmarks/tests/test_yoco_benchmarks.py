"""The YoCo benchmarks' model shape is a valid V4.1 engine config with consumer layers, and the
quality script's agreement measures count what they say."""

from __future__ import annotations

import pytest

from benchmarks.engine.bench_yoco_prefill import v41_yoco_config
from benchmarks.engine.yoco_quality import agreement
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.yoco import consumer_boundary, prefill_truncation


@pytest.mark.parametrize(("layers", "consumers"), [(16, 8), (40, 20), (12, 4)])
def test_yoco_prefill_shape_has_its_consumer_half(layers, consumers) -> None:
    config = parse_config(v41_yoco_config(layers, consumers))
    assert config.num_layers == layers and config.hidden_size == 5120
    assert consumer_boundary(config) == layers - consumers
    assert prefill_truncation(config, "compact", 0, 0).keep_tokens == 128
    with pytest.raises(ValueError, match="expected >= 3 / >= 1"):
        v41_yoco_config(4, 2)


def test_agreement_counts_positions_prefixes_and_identical_runs() -> None:
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = agreement(base, [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got == {"token_agreement": 7 / 8, "mean_common_prefix": 3.0, "identical_share": 0.5}
