"""The step-cost curve is measured once per device, model and configuration and reused from
disk; another configuration, ``DEEPINFER_REMEASURE_STEP_COST=1`` or an unreadable file measure
again."""

from __future__ import annotations

import torch

from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.runner import cost_profile
from deepinfer.engine.runner.cost_cache import cached_step_cost_curve, curve_key
from deepinfer.engine.testing import tiny_v41_config
from deepinfer.spec import StepCostCurve


def _counting(cost: float):
    calls = []

    def measure():
        calls.append(1)
        return StepCostCurve((1, 8), (cost, cost * 2))

    return measure, calls


def test_a_stored_curve_is_reused_until_asked_to_remeasure(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    key = curve_key(device="H200", model="abc", drafts=5)
    measure, calls = _counting(3.0)
    first = cached_step_cost_curve(key, measure)
    again = cached_step_cost_curve(key, _counting(9.0)[0])  # not measured: read back
    assert len(calls) == 1 and again.cost == first.cost == (3.0, 6.0)
    other, other_calls = _counting(4.0)
    assert (
        cached_step_cost_curve(curve_key(device="H200", model="abc", drafts=3), other).cost[0]
        == 4.0
    )
    assert len(other_calls) == 1
    monkeypatch.setenv("DEEPINFER_REMEASURE_STEP_COST", "1")
    assert cached_step_cost_curve(key, _counting(5.0)[0]).cost[0] == 5.0
    monkeypatch.delenv("DEEPINFER_REMEASURE_STEP_COST")
    assert cached_step_cost_curve(key, _counting(7.0)[0]).cost[0] == 5.0  # the new one stays
    for path in (tmp_path / "step_cost").iterdir():
        path.write_text("{not json")
    assert cached_step_cost_curve(key, _counting(6.0)[0]).cost[0] == 6.0


def test_the_model_is_timed_once_for_a_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    model = build_model(parse_config(tiny_v41_config(vision=False, engram_layer_ids=[])), device=torch.device("cpu"),
                        dtype=torch.float32, include_mtp=False)  # fmt: skip
    timed = []
    real = cost_profile.measure_step_cost_curve

    def measure(*args, **kwargs):
        timed.append(kwargs["max_tokens"])
        return real(*args, **kwargs, runs=1)

    monkeypatch.setattr(cost_profile, "measure_step_cost_curve", measure)
    settings = dict(
        num_draft_tokens=1, block_size=16, dtype=torch.float32, device=torch.device("cpu")
    )
    first = cost_profile.step_cost_curve(model, max_tokens=4, **settings)
    assert first.num_tokens == (1, 2, 4) and all(c > 0 for c in first.cost)
    assert cost_profile.step_cost_curve(model, max_tokens=4, **settings) == first
    cost_profile.step_cost_curve(model, max_tokens=2, **settings)
    assert timed == [4, 2]
