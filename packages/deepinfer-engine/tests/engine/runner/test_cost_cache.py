"""The step-cost curve is measured once per device, model and configuration and reused from
disk; another configuration, ``DEEPINFER_REMEASURE_STEP_COST=1``, ``remeasure=True`` or an
unreadable file measure again. Measured through the step graphs when the runner has them."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.runner import cost_profile
from deepinfer.engine.runner.cost_cache import (
    cache_dir,
    cached_step_cost_curve,
    curve_key,
    curve_path,
)
from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
from deepinfer.engine.testing import tiny_v41_config
from deepinfer.spec import StepCostCurve

KEY = curve_key(device="NVIDIA H200", model="abc", drafts=5)


def _counting(cost: float):
    calls = []

    def measure():
        calls.append(1)
        return StepCostCurve((1, 8), (cost, cost * 2))

    return measure, calls


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_REMEASURE_STEP_COST", raising=False)
    return tmp_path


def test_a_stored_curve_is_reused_without_measuring(in_tmp):
    measure, calls = _counting(3.0)
    first = cached_step_cost_curve(KEY, measure)
    again, again_calls = _counting(9.0)
    assert cached_step_cost_curve(KEY, again) == first
    assert len(calls) == 1 and not again_calls and first.cost == (3.0, 6.0)
    path = curve_path(KEY)
    assert path.parent == in_tmp / "cost_curves" and path.name.startswith("NVIDIA-H200-")
    assert json.loads(path.read_text())["key"] == KEY


def test_another_key_measures_again(in_tmp):
    cached_step_cost_curve(KEY, _counting(3.0)[0])
    for other in (curve_key(device="NVIDIA H200", model="abc", drafts=3),
                  curve_key(device="NVIDIA H100", model="abc", drafts=5),
                  curve_key(device="NVIDIA H200", model="abd", drafts=5)):  # fmt: skip
        measure, calls = _counting(4.0)
        assert cached_step_cost_curve(other, measure).cost[0] == 4.0 and len(calls) == 1
    assert cached_step_cost_curve(KEY, _counting(9.0)[0]).cost[0] == 3.0  # still stored


def test_the_switches_force_a_measurement(in_tmp, monkeypatch):
    cached_step_cost_curve(KEY, _counting(3.0)[0])
    assert cached_step_cost_curve(KEY, _counting(5.0)[0], remeasure=True).cost[0] == 5.0
    monkeypatch.setenv("DEEPINFER_REMEASURE_STEP_COST", "1")
    assert cached_step_cost_curve(KEY, _counting(6.0)[0]).cost[0] == 6.0
    monkeypatch.delenv("DEEPINFER_REMEASURE_STEP_COST")
    assert cached_step_cost_curve(KEY, _counting(7.0)[0]).cost[0] == 6.0  # the new one stays


@pytest.mark.parametrize(
    "text", ["{not json", '{"key": 1}', '{"num_tokens": [1], "cost": [1.0]}', "[]",
             json.dumps({"key": KEY, "num_tokens": [2, 1], "cost": [1.0, 2.0]}),
             json.dumps({"key": {**KEY, "drafts": "4"}, "num_tokens": [1], "cost": [1.0]})],
)  # fmt: skip
def test_a_corrupt_file_warns_and_measures_again(in_tmp, caplog, text):
    path = curve_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    measure, calls = _counting(6.0)
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
        assert cached_step_cost_curve(KEY, measure).cost[0] == 6.0
    assert len(calls) == 1
    assert any(str(path) in r.getMessage() and "measuring again" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert json.loads(path.read_text())["cost"] == [6.0, 12.0]  # rewritten, readable again


def test_the_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "deepinfer"
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def _model():
    config = parse_config(tiny_v41_config(vision=False, engram_layer_ids=[]))
    return build_model(config, device=torch.device("cpu"), dtype=torch.float32,
                       include_mtp=True)  # fmt: skip


def test_the_model_is_timed_once_for_a_configuration(in_tmp, monkeypatch):
    model = _model()
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
    cost_profile.step_cost_curve(model, max_tokens=2, remeasure=True, **settings)
    assert timed == [4, 2, 2]


def test_with_graphs_every_step_goes_through_them(in_tmp, monkeypatch):
    """The runner's graphs (here their fixed-shape forward, uncaptured on CPU) run each size
    they take, on the runner's cache; a larger size runs eagerly."""
    model = _model()
    drafts = 2
    cache = ModelCache(model.config, CacheLayout(9, 5, 16, max_draft=drafts),
                       dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    model.mtp.allocate(cache)
    graphs = DecodeGraphs(model, cache, max_batch_size=8, max_context=64, capture=False,
                          speculative=True)  # fmt: skip
    taken = []
    run = graphs.run

    def counted(plan, rows):
        logits = run(plan, rows)
        taken.append((plan.num_tokens, logits is not None))
        return logits

    monkeypatch.setattr(graphs, "run", counted)
    curve = cost_profile.measure_step_cost_curve(
        model, num_draft_tokens=drafts, max_tokens=12, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"), graphs=graphs, runs=1,
    )  # fmt: skip
    assert curve.num_tokens == (1, 2, 4, 8, 12)
    assert sorted(set(taken)) == [(1, True), (2, True), (4, True), (8, True), (12, False)]
    assert len(taken) == 5 * 3  # two warm-up runs and one timed run per size
    assert torch.isfinite(cache.tensors[next(iter(cache.tensors))]).all()


def test_the_dummy_step_is_a_verification_layout():
    layout = CacheLayout(4, 3, 16, max_draft=3)
    plan = cost_profile.dummy_verify_plan(100, 10, 4, 1, layout)
    assert plan.cu_seqlens_q == [0, 4, 8, 10] and plan.seq_lens == [4, 4, 2]
    assert plan.positions == [0, 1, 2, 3] * 2 + [0, 1] and plan.num_drafts == [3, 3, 1]
    assert plan.block_tables == [[1], [2], [3]] and plan.state_slots == [1, 2, 1]
    assert len(set(plan.input_ids)) > 1 and plan.sample_rows == list(range(10))
