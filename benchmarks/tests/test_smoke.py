"""The benchmark sweep never rots: its CPU smoke mode runs end to end and writes every point,
and its roofline reproduces the arithmetic of ``shared/specs/performance.md`` section 4.

The benchmarks are the ``benchmarks`` package of the repository root (``python -m pytest`` from
the root, as nox runs it, has the root on ``sys.path``); the scripts run as ``python -m``."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sweep.models import V4_FLASH_RATIOS, resolve_model
from benchmarks.sweep.plots import _plot, matplotlib_missing
from benchmarks.sweep.roofline import Device, ModelShape, decode_point

REPO = Path(__file__).resolve().parents[2]

H200_2GPU = Device(bandwidth=4.3e12, flops=1.4e15)  # the spec's per-GPU assumptions


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sweep")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(REPO / "benchmarks" / "run_sweep.sh"), "--smoke", "--out", str(out)],
                   check=True, env=env, cwd=REPO, timeout=120)  # fmt: skip
    (json_path,) = out.glob("*.json")
    return out, json.loads(json_path.read_text())


def test_smoke_writes_every_point_with_consistent_throughputs(smoke) -> None:
    _, result = smoke
    ours = result["ours"]
    assert [p["tokens"] for p in ours["prefill"]] == [64, 128]
    assert [p["batch"] for p in ours["decode"]] == [1, 4]
    for p in ours["prefill"]:
        assert p["tok/s/gpu"] > 0
        assert p["tok/s/gpu"] * p["step_ms"] / 1e3 == pytest.approx(p["tokens"])
    for p in ours["decode"]:
        assert p["tok/s/user"] > 0
        assert p["tok/s/gpu"] == pytest.approx(p["batch"] * p["tok/s/user"])
    assert "deepseek_v41" in result["baseline"]["skipped"]  # tiny model is V4.1: no HF twin
    assert result["env"]["torch"] and result["env"]["triton"] and result["command"]


def test_smoke_measurements_sit_under_the_roofline(smoke) -> None:
    _, result = smoke
    roof = result["roofline"]
    assert roof["device"]["bandwidth_Bps"] > 0 and roof["device"]["matmul_flops"] > 0
    ceiling = {p["batch"]: p["tok/s/gpu"] for p in roof["decode"]}
    for p in result["ours"]["decode"]:
        assert p["tok/s/gpu"] < ceiling[p["batch"]]
    prefill_ceiling = {p["tokens"]: p["tok/s/gpu"] for p in roof["prefill"]}
    for p in result["ours"]["prefill"]:
        assert p["tok/s/gpu"] < prefill_ceiling[p["tokens"]]


def test_smoke_writes_plots_when_matplotlib_is_present(smoke) -> None:
    out, _ = smoke
    pngs = sorted(p.name.rsplit("-", 1)[1] for p in out.glob("*.png"))
    assert pngs == ([] if matplotlib_missing() else ["decode.png", "prefill.png"])


class RecordingAxes:
    """Stands in for a matplotlib Axes: records the series drawn."""

    def __init__(self) -> None:
        self.series: list[tuple[list, list, str]] = []

    def plot(self, xs, ys, style, **kwargs) -> None:
        self.series.append((list(xs), list(ys), kwargs["label"]))

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_plot_draws_roofline_ours_and_baseline() -> None:
    point = {"batch": 2, "tok/s/user": 3.0, "tok/s/gpu": 6.0}
    roof = {"batch": 2, "tok/s/user": 30.0, "tok/s/gpu": 60.0}
    result = {"roofline": {"decode": [roof]}, "ours": {"decode": [point]},
              "baseline": {"decode": [{**point, "tok/s/gpu": 1.5}]}}  # fmt: skip
    ax = RecordingAxes()
    _plot(ax, result, "decode", "tok/s/user", "tok/s/gpu")
    assert [(s[2].split()[0], s[1]) for s in ax.series] == [
        ("roofline", [60.0]), ("DeepInfer", [6.0]), ("transformers", [1.5])
    ]  # fmt: skip
    result["baseline"] = {"skipped": "no transformers twin"}
    ax = RecordingAxes()
    _plot(ax, result, "decode", "tok/s/user", "tok/s/gpu")
    assert [s[2].split()[0] for s in ax.series] == ["roofline", "DeepInfer"]


# --------------------------------------------------------------- roofline vs performance.md
@pytest.fixture(scope="module")
def v4_flash() -> ModelShape:
    return ModelShape.from_config(resolve_model("v4-flash-dummy", 43).config)


def test_v4_flash_parameter_counts_match_the_spec(v4_flash) -> None:
    assert v4_flash.compress_ratios == tuple(V4_FLASH_RATIOS)
    assert v4_flash.expert_bytes / 1e6 == pytest.approx(13.37, rel=1e-3)
    assert v4_flash.total_params / 1e9 == pytest.approx(284.3, rel=0.01)
    assert v4_flash.active_params / 1e9 == pytest.approx(13.2, rel=0.01)
    assert 2 * v4_flash.active_params / 1e9 == pytest.approx(26.5, rel=0.01)
    assert v4_flash.flops_per_token(8192) / 1e9 == pytest.approx(29.5, rel=0.02)


@pytest.mark.parametrize(("batch", "distinct"), [(1, 6), (32, 136), (64, 200), (256, 255.4)])
def test_distinct_experts_match_the_spec(v4_flash, batch, distinct) -> None:
    assert v4_flash.distinct_experts(batch) == pytest.approx(distinct, abs=0.5)


@pytest.mark.parametrize(
    ("batch", "gigabytes", "tok_s_gpu"),
    [(1, 10.9, 396), (32, 86, 1598), (64, 123, 2234), (256, 158, 6981)],
)
def test_decode_step_bytes_and_throughput_match_the_spec(v4_flash, batch, gigabytes, tok_s_gpu):
    point = decode_point(v4_flash, H200_2GPU, batch, context=8192)
    assert point["bytes"] / 1e9 == pytest.approx(gigabytes, rel=0.03)
    assert point["tok/s/gpu"] == pytest.approx(tok_s_gpu, rel=0.03)
    assert point["t_mem_s"] > point["t_comp_s"]  # memory-bound below B ~ 1,700


def test_kv_traffic_at_8k_matches_the_spec(v4_flash) -> None:
    assert v4_flash.kv_bytes_per_token(8192) / 1e6 == pytest.approx(13, rel=0.05)


def test_roofline_scales_with_the_layer_count() -> None:
    shapes = [ModelShape.from_config(resolve_model("v4-flash-dummy", n).config) for n in (4, 8)]
    experts = [s.weight_bytes_per_step(1) - s.weight_bytes_per_step(0) for s in shapes]
    assert experts[1] == pytest.approx(2 * experts[0])


def test_v41_dummy_shape_is_a_valid_engine_config_and_layers_are_validated() -> None:
    from deepinfer.engine.model.config_parsing import parse_config

    source = resolve_model("v41-flash-dummy", 4)
    assert "4 of 40 layers" in source.label
    assert parse_config(source.config).architecture == "DeepseekV41ForCausalLM"
    with pytest.raises(ValueError, match="--layers: got 44"):
        resolve_model("v4-flash-dummy", 44)


@pytest.mark.slow
def test_v4_checkpoint_sweep_runs_the_transformers_baseline_side_by_side(tmp_path) -> None:
    from deepinfer.engine.testing import tiny_v4_config
    from deepinfer.engine.testing.random_checkpoint import make_random_checkpoint

    checkpoint = make_random_checkpoint(
        tmp_path / "v4", tiny_v4_config(num_nextn_predict_layers=0), quantized=True
    )
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.sweep.run_sweep", "--model",
         str(checkpoint), "--prefill-tokens", "32,64", "--prompt-len", "16", "--concurrency",
         "1,2", "--context-len", "16", "--decode-tokens", "3", "--repeats", "1", "--out", str(out)],
        check=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    (json_path,) = out.glob("*.json")
    result = json.loads(json_path.read_text())
    ours, theirs = result["ours"], result["baseline"]
    assert [p["batch"] for p in theirs["decode"]] == [1, 2]
    assert all(p["tok/s/gpu"] > 0 for p in theirs["prefill"] + theirs["decode"])
    for phase, key in (("prefill", "tokens"), ("decode", "batch")):
        assert [a[key] for a in ours[phase]] == [b[key] for b in theirs[phase]]
        expected = [a["tok/s/gpu"] / b["tok/s/gpu"] for a, b in zip(ours[phase], theirs[phase])]
        got = [r["ratio"] for r in result["ratio_to_baseline"][phase]]
        assert got == pytest.approx(expected)


def test_decode_steps_count_only_steps_that_ran_the_whole_batch() -> None:
    from benchmarks.sweep.measure import full_batch_step_seconds

    rng = random.Random(0)
    # Sequence 0 starts two steps early (prefill chunking); steps have random durations.
    step_ends = list(itertools.accumulate(rng.uniform(0.5, 1.5) for _ in range(8)))
    early, late = step_ends[0:6], step_ends[2:8]
    intervals = full_batch_step_seconds([early, late])
    # Full-batch steps: those ending at step_ends[3..5] (both decoding, sequence 0 not done).
    assert intervals == pytest.approx([step_ends[k] - step_ends[k - 1] for k in (3, 4, 5)])
    assert full_batch_step_seconds([[1.0, 2.0], [3.0, 4.0]]) == []


def test_a_sweep_stops_after_a_point_over_the_time_budget() -> None:
    from benchmarks.sweep.measure import SweepSettings, decode_sweep, prefill_sweep

    def fake_generate(prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        times = list(itertools.accumulate([0.01] * max_tokens))
        return [times] * len(prompts)

    settings = SweepSettings(
        prefill_tokens=(32, 64, 128), prompt_len=16, concurrency=(1, 2, 4), context_len=8,
        decode_tokens=4, repeats=1, vocab_size=64,
    )  # fmt: skip
    assert len(prefill_sweep(fake_generate, settings)) == 3
    assert [p["batch"] for p in decode_sweep(fake_generate, settings)] == [1, 2, 4]
    stopped = dataclasses.replace(settings, max_point_s=0.0)
    assert [p["tokens"] for p in prefill_sweep(fake_generate, stopped)] == [32]
    (point,) = decode_sweep(fake_generate, stopped)
    assert point["step_ms"] == pytest.approx(10.0)


def test_auto_layer_count_fits_half_the_free_memory(monkeypatch) -> None:
    import torch

    from benchmarks.sweep import run_sweep

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (140e9, 141e9))
    layers = {}
    for name in ("v4-flash-dummy", "v41-flash-dummy"):
        for baseline in ("transformers", "none"):
            args = argparse.Namespace(layers=None, baseline=baseline)
            layers[name, baseline] = run_sweep.auto_layers(name, args, "cuda")
            source = resolve_model(name, layers[name, baseline])
            shape = ModelShape.from_config(source.config)
            routed = shape.num_layers * shape.num_experts * shape.expert_params
            bytes_per_param = 2 if baseline == "transformers" and "v4-" in name else 0.6
            assert (routed + shape.dense_params_per_step) * bytes_per_param <= 0.5 * 140e9
    # bf16 experts for the baseline leave room for fewer layers than FP4 alone
    assert layers["v4-flash-dummy", "transformers"] < layers["v4-flash-dummy", "none"]
    assert run_sweep.auto_layers("tiny", argparse.Namespace(layers=None), "cuda") is None


def test_write_plots_draws_both_charts_of_a_smoke_result(smoke, monkeypatch, tmp_path) -> None:
    """The whole plotting path on the smoke JSON, with matplotlib replaced by a recorder (the
    real library may be absent here; with it, the smoke test above checks the PNGs)."""
    import types

    from benchmarks.sweep import plots

    _, result = smoke
    figures = []

    class Figure:
        def __init__(self) -> None:
            self.ax = RecordingAxes()

        def savefig(self, path) -> None:
            Path(path).write_bytes(b"png")

        def tight_layout(self) -> None:
            pass

    def subplots(**kwargs):
        figures.append(Figure())
        return figures[-1], figures[-1].ax

    pyplot = types.SimpleNamespace(subplots=subplots, close=lambda fig: None)
    fake = types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    paths = plots.write_plots(result, tmp_path, "smoke")
    assert [p.name for p in paths] == ["smoke-prefill.png", "smoke-decode.png"]
    assert all(p.is_file() for p in paths)
    prefill, decode = ([s[2].split()[0] for s in f.ax.series] for f in figures)
    assert prefill == decode == ["roofline", "DeepInfer"]  # tiny model: baseline skipped
    ours_decode = figures[1].ax.series[1]
    assert ours_decode[1] == [p["tok/s/gpu"] for p in result["ours"]["decode"]]


@pytest.mark.slow
@pytest.mark.xdist_group("bench_spec_smoke")  # its own work unit, beside the sweep's
def test_spec_bench_smoke_reports_every_mode_and_the_cost_curve(tmp_path) -> None:
    out = tmp_path / "spec.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.engine.bench_spec", "--smoke",
         "--out", str(out)],
        check=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        (m, b) for m in ("off", "fixed", "varlen") for b in (1, 2)
    ]
    for r in rows:
        assert r["tok/s/user"] > 0 and r["tok/s"] == pytest.approx(r["batch"] * r["tok/s/user"])
        assert 0 <= r["accepted"] <= r["drafts"] and r["accept_len"] >= 1.0
        assert (r["k"] == 0) == (r["mode"] == "off") and (r["drafts"] > 0) == (r["k"] > 0)
    curve = result["step_cost_curves"]["varlen"]
    assert curve["num_tokens"][0] == 1 and len(curve["ms"]) == len(curve["num_tokens"])
    assert all(b >= a > 0 for a, b in zip(curve["ms"], curve["ms"][1:]))
    assert result["env"]["torch"] and result["command"]
