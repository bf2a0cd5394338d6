"""The prefill tools count and time what they say: the shared timing helper never times its
warm-up, the per-layer prefill FLOPs match a position-by-position count, the op recorder counts
an op's products and groups profiler time by op, the long-prompt chunk arithmetic behaves, and
the breakdown runs end to end on CPU on a tiny V4 checkpoint."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from benchmarks.engine import long_prefill, prefill_breakdown
from benchmarks.engine.op_work import OpRecorder
from benchmarks.sweep.models import resolve_model
from benchmarks.sweep.roofline import H200, Device, ModelShape, prefill_point
from benchmarks.timing import time_call


def test_time_call_leaves_out_the_warm_up_and_takes_the_median() -> None:
    durations = iter([0.3, 0.03, 0.01, 0.02])
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(next(durations))

    timing = time_call(fn, warmup=1, repeats=3)
    assert len(calls) == 4 and len(timing.samples_s) == 3
    assert max(timing.samples_s) < 0.25  # the slow first call was not timed
    assert timing.median_s == sorted(timing.samples_s)[1]
    assert timing.record()["warmup"] == 1 and "host scheduling" in timing.record()["timed"]
    with pytest.raises(ValueError, match="repeats=0"):
        time_call(fn, repeats=0)


@pytest.fixture(scope="module")
def v4_flash() -> ModelShape:
    return ModelShape.from_config(resolve_model("v4-flash-dummy", 43).config)


def _brute_force_layer(shape: ModelShape, ratio: int, start: int, end: int) -> dict[str, float]:
    """The attention and indexer FLOPs of a chunk, one token at a time."""
    attention = indexer = 0.0
    for n in range(start + 1, end + 1):  # token n sees n tokens (itself included)
        entries = min(n, shape.sliding_window)
        if ratio == 4:
            entries += min(shape.index_topk, n // 4)
            indexer += 2 * shape.index_heads * shape.index_head_dim * (n // 4)
        elif ratio:
            entries += n // ratio
        attention += 4 * shape.num_heads * shape.head_dim * entries
    return {"attention": attention, "indexer": indexer}


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_layer_work_matches_a_token_by_token_count(v4_flash, ratio) -> None:
    rng = random.Random(ratio)
    for _ in range(4):
        start = rng.randrange(0, 5000)
        end = start + rng.randrange(1, 3000)
        work = v4_flash.prefill_layer_work(ratio, start, end)
        expected = _brute_force_layer(v4_flash, ratio, start, end)
        assert work["attention"] == pytest.approx(expected["attention"], rel=1e-12)
        assert work["indexer"] == pytest.approx(expected["indexer"], rel=1e-12)
        whole = v4_flash.prefill_layer_work(ratio, 0, end)["attention"]
        head = v4_flash.prefill_layer_work(ratio, 0, start)["attention"]
        assert whole == pytest.approx(head + work["attention"], rel=1e-12)


def test_v41_layers_select_the_top_k_and_only_index_sources_scan() -> None:
    v41 = ModelShape.from_config(resolve_model("v41-flash-dummy", 40).config)
    source, reader = 20, 21  # ratio-1 layers: 20 runs the indexer, 21 reuses its top-k
    assert v41.compress_ratios[source] == v41.compress_ratios[reader] == 1
    start, end = 700, 1900
    expected = sum(4 * v41.num_heads * v41.head_dim
                   * (min(n, v41.sliding_window) + min(v41.index_topk, n))
                   for n in range(start + 1, end + 1))  # fmt: skip
    scan = sum(2 * v41.index_heads * v41.index_head_dim * n for n in range(start + 1, end + 1))
    for layer in (source, reader):
        work = v41.prefill_layer_work(1, start, end, layer)
        assert work["attention"] == pytest.approx(expected, rel=1e-12)
        assert work["indexer"] == pytest.approx(scan if layer == source else 0.0, rel=1e-12)


def test_prefill_roofline_matches_the_spec_at_8k(v4_flash) -> None:
    # performance.md section 4: ~43k tok/s/GPU at 1.4 PFLOP/s FP8, 0.62 PFLOP/s attention
    spec_rates = Device(bandwidth=4.3e12, flops=1.4e15, attention_flops=0.62e15)
    assert prefill_point(v4_flash, spec_rates, 8192, 8192)["tok/s/gpu"] == pytest.approx(43e3, rel=0.08)  # fmt: skip
    long = prefill_point(v4_flash, H200, 131072, 131072)["tok/s/gpu"]
    assert long < prefill_point(v4_flash, H200, 8192, 8192)["tok/s/gpu"]  # attention grows


def test_op_recorder_counts_products_and_bytes_of_outermost_calls() -> None:
    from deepinfer.kernels import ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen)
    w = torch.randn(80, 96, generator=gen)
    norm_weight = torch.rand(80, generator=gen) + 0.5
    recorder = OpRecorder(H200)
    with recorder.active():
        y = ops.linear(x, w)
        ops.rms_norm(y, norm_weight, 1e-6)
        inner = recorder._wrap("linear", lambda a, b: ops.rms_norm(a @ b.T, norm_weight, 1e-6))
        inner(x, w)  # an op called inside another op belongs to the outer one
    torch.testing.assert_close(y, x @ w.T)
    assert recorder.work["linear"].calls == 2 and recorder.work["rms_norm"].calls == 1
    assert recorder.work["linear"].flops == 2 * 2 * 37 * 80 * 96
    assert recorder.work["rms_norm"].bytes == 37 * 80 * 4 * 2 + 80 * 4
    assert recorder.work["linear"].rates == {"bf16"}
    # each call: its products at the bf16 rate or its weight read, whichever takes longer
    per_call = max(2 * 37 * 80 * 96 / 786e12, 80 * 96 * 4 / 4.25e12)
    assert recorder.work["linear"].floor_s == pytest.approx(2 * per_call)
    ops.linear(x, w)  # outside the recorder: not counted
    assert recorder.work["linear"].calls == 2


def test_kernels_belong_to_the_outermost_op_else_to_the_outermost_torch_op() -> None:
    from types import SimpleNamespace as Event

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, parent=None, kernels=()):
        kernels = [Event(name=n, duration=us) for n, us in kernels]
        return Event(name=name, cpu_parent=parent, kernels=kernels, device_type=cpu)

    linear = event("op:linear", kernels=[("op:linear", 99.0)])  # its own annotation
    mm = event("aten::mm", linear, [("gemm_a", 30.0), ("gemm_b", 10.0)])
    cat = event("aten::cat")
    copy = event("aten::copy_", cat, [("copy_kernel", 5.0)])
    device_side = Event(name="gemm_a", cpu_parent=None, kernels=[], device_type=cuda)
    events = [linear, mm, cat, copy, device_side]
    groups = prefill_breakdown.group_times(events, on_cuda=True)
    assert groups == {
        "linear": (pytest.approx(40e-6), 1),
        "torch aten::cat": (pytest.approx(5e-6), 1),
    }
    kernels = prefill_breakdown.top_kernels(events)
    assert kernels["linear"] == [("gemm_a", 0.03), ("gemm_b", 0.01)]


def test_marked_ops_own_the_kernels_between_their_markers() -> None:
    """Triton kernels have no launch record: an op's markers on the device delimit its kernels;
    kernels outside every op go to their launch record's torch op, else to their own group."""
    from types import SimpleNamespace as Event

    from benchmarks.engine.op_markers import BEGIN, END, UNOWNED

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def host(name, parent=None, kernels=()):
        kernels = [Event(name=n, duration=us) for n, us in kernels]
        return Event(name=name, cpu_parent=parent, kernels=kernels, device_type=cpu)

    def device(name, start, end):
        return Event(name=name, time_range=Event(start=start, end=end), device_type=cuda,
                     cpu_parent=None, kernels=[])  # fmt: skip

    linear = host("op:linear")
    quant = host("aten::abs", linear, [("abs_kernel", 2.0)])  # a linked kernel inside the op
    cat = host("aten::cat")
    copy = host("aten::copy_", cat, [("copy_kernel", 5.0)])
    timeline = [  # shuffled: the walk orders by start
        device("copy_kernel", 40, 45), device(f"{BEGIN}_0d1", 0, 1), device("abs_kernel", 2, 4),
        device("fp8_gemm_kernel", 5, 25), device(f"{END}_0d1", 26, 27),
        device("rms_norm_kernel", 30, 33), device(f"{BEGIN}_0d1", 50, 51),
        device("fp8_gemm_kernel", 52, 60), device(f"{END}_0d1", 61, 62), device("triton_other", 70, 77),
    ]  # fmt: skip
    events = [linear, quant, cat, copy, *timeline]
    calls = ["linear", "rms_norm"]
    with pytest.raises(ValueError, match="2 op markers on the device for 3"):  # a call unmarked
        prefill_breakdown.marked_ops(events, calls + ["rms_norm"])
    # the rms_norm kernel at 30 ran between the two ops' markers: no op launched it
    marked = prefill_breakdown.marked_ops(events, calls)
    groups = prefill_breakdown.group_times(events, on_cuda=True, marked=marked)
    assert groups == {
        "linear": (pytest.approx(22e-6), 2),
        "rms_norm": (pytest.approx(8e-6), 1),
        "torch aten::cat": (pytest.approx(5e-6), 1),
        UNOWNED: (pytest.approx(10e-6), 0),  # rms_norm_kernel (3) + triton_other (7)
    }
    kernels = prefill_breakdown.top_kernels(events, marked=marked)
    assert kernels["linear"] == [("fp8_gemm_kernel", 0.02), ("abs_kernel", 0.002)]
    assert kernels["torch aten::cat"] == [("copy_kernel", 0.005)]


def test_sweep_tables_carry_the_roofline_and_our_share_of_it() -> None:
    from benchmarks.sweep.run_sweep import with_roofline

    points = [{"tokens": 1024, "tok/s/gpu": 500.0}, {"tokens": 3000, "tok/s/gpu": 9.0}]
    roof = [{"tokens": 1024, "tok/s/gpu": 2000.0}, {"tokens": 2048, "tok/s/gpu": 3000.0}]
    got = with_roofline(points, roof, "tokens")
    assert got[0]["roofline"] == 2000.0 and got[0]["of_roofline"] == 0.25
    assert "roofline" not in got[1]  # no roofline point at that size


def test_expert_tiles_fill_up_as_the_chunk_grows() -> None:
    # V4-Flash: 256 experts, top-6; 2,048 tokens give 48 rows per expert in 128-row tiles
    used = [long_prefill.expert_tile_utilisation(c, 6, 256) for c in (2048, 8192, 65536)]
    assert used[0] == pytest.approx(48 / 128, rel=0.01)
    assert used[0] < used[1] < used[2] < 1.0


def test_a_long_prompt_runs_below_the_8k_rate_whatever_the_chunk(v4_flash) -> None:
    table = long_prefill.chunk_table(v4_flash, H200, 131072, [2048, 8192, 32768], 0.02)
    rates = [row["of_8k_rate"] for row in table]
    assert rates[0] < rates[1] < rates[2] < 1.0  # bigger chunks help, attention still grows
    assert [row["steps"] for row in table] == [64, 16, 4]
    assert table[2]["indexer_gib"] == pytest.approx(4 * table[1]["indexer_gib"])


def test_breakdown_runs_on_cpu_on_a_tiny_v4_checkpoint(tmp_path) -> None:
    from deepinfer.engine.testing import tiny_v4_config
    from deepinfer.engine.testing.random_checkpoint import make_random_checkpoint

    checkpoint = make_random_checkpoint(
        tmp_path / "v4", tiny_v4_config(num_nextn_predict_layers=0), quantized=False
    )
    out = tmp_path / "out"
    argv = ["--model", str(checkpoint), "--accelerator", "cpu", "--shapes", "2x16",
            "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert prefill_breakdown.main(argv) == 0
    (path,) = out.glob("*-prefill-breakdown-*.json")
    (model,) = json.loads(path.read_text())["models"]
    (shape,) = model["shapes"]
    assert shape["tokens"] == 32 and shape["wall_ms"] > 0
    rows = {row["op"]: row for row in shape["rows"]}
    for op in ("linear", "sparse_mqa_sink", "indexer_scores", "rms_norm"):
        assert rows[op]["ms"] > 0 and rows[op]["ceiling_ms"] > 0
        assert rows[op]["host_ms"] >= rows[op]["ms"] * 0.99  # CPU: the op's own time is host
    assert any(op.startswith("torch aten::") for op in rows)  # work outside the ops
    assert rows["sparse_mqa_sink"]["gflop"] > 0
    assert sum(r["share"] for r in shape["rows"][:-1]) == pytest.approx(1.0, abs=0.01)
    with pytest.raises(SystemExit):
        prefill_breakdown.main(["--shapes", "8by1024", "--out", str(out)])
