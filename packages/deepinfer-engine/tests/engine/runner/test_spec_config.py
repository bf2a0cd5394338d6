"""How speculation is switched on and sized: the explicit argument beats
``DEEPINFER_USE_NEXTN_DECODE``, values are checked against the checkpoint's DSpark block size
(an explicit one fails, the environment's is capped), checkpoints without DSpark stages never
speculate, the cache gets ``window + K`` rings plus the draft rings, and confidence-scheduled
verification measures its step-cost curve at start-up when none is given."""

from __future__ import annotations

import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.cache import cache_footprint
from deepinfer.engine.runner import cost_profile
from deepinfer.engine.runner.cost_profile import profile_sizes
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.sampling import SamplingParams


def _engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), dtype="float32", block_size=16, max_model_len=160, **kwargs)


def test_explicit_count_beats_the_environment(dspark_checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert _engine(dspark_checkpoint)._core.executor.spec is None
    runner = _engine(dspark_checkpoint, speculative_tokens=2)._core.executor
    assert runner.spec.num_draft_tokens == 2
    assert runner.cache.ring_size == runner.model.config.sliding_window + 2
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert _engine(dspark_checkpoint, speculative_tokens=0)._core.executor.spec is None


def test_counts_above_the_block_size(dspark_checkpoint, monkeypatch, caplog):
    with pytest.raises(ValueError, match=r"speculative_tokens=4: expected 0\.\.3"):
        _engine(dspark_checkpoint, speculative_tokens=4)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")  # the default, on a block of 3
    runner = _engine(dspark_checkpoint)._core.executor
    assert runner.spec.num_draft_tokens == 3
    assert "above the checkpoint's dspark_block_size=3" in caplog.text


@pytest.mark.parametrize(
    "field, value",
    [("speculative_tokens", -1), ("speculative_tokens", True), ("spec_acceptance", "greedy"),
     ("spec_varlen", "yes"), ("return_draft_confidences", 1), ("spec_cost_curve", [1, 2])],
)  # fmt: skip
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="x", **{field: value})


def test_checkpoints_without_dspark_never_speculate(tmp_path):
    make_random_checkpoint(tmp_path, tiny_v4_config(), quantized=False, seed=0)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256)  # V4 MTP block: no DSpark
    assert llm._core.executor.spec is None
    with pytest.raises(ValueError, match="no DSpark draft stages"):
        LLM(str(tmp_path), dtype="float32", max_model_len=256, speculative_tokens=2)


def test_state_slots_count_the_draft_rings(dspark_checkpoint):
    runner = _engine(dspark_checkpoint, speculative_tokens=3)._core.executor
    config, cache = runner.model.config, runner.cache
    slots = cache.layout.num_slots
    draft_keys = [k for k in cache.tensors if int(k.split(".")[0]) >= config.num_layers]
    assert len(draft_keys) == config.num_mtp_layers
    per_slot = cache_footprint(config, block_size=16, max_draft=3, dtype=cache.dtype).bytes_per_slot
    draft = sum(cache.tensors[k].numel() * cache.tensors[k].element_size() for k in draft_keys)
    assert (
        draft // slots == config.num_mtp_layers * (config.sliding_window + 3) * config.head_dim * 4
    )
    assert per_slot > 0


def test_varlen_measures_a_step_cost_curve(dspark_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    measured = []
    real = cost_profile.measure_step_cost_curve
    monkeypatch.setattr(cost_profile, "measure_step_cost_curve",
                        lambda *a, **k: measured.append(1) or real(*a, **k))  # fmt: skip
    llm = _engine(dspark_checkpoint, speculative_tokens=3, max_num_seqs=3)
    curve = llm._core.executor.spec.cost_curve
    assert curve.num_tokens == tuple(profile_sizes(12)) == (1, 2, 4, 8, 12)
    assert all(b >= a > 0 for a, b in zip(curve.cost, curve.cost[1:]))
    assert len(list((tmp_path / "cost_curves").iterdir())) == 1 and len(measured) == 1
    again = _engine(dspark_checkpoint, speculative_tokens=3, max_num_seqs=3)
    assert again._core.executor.spec.cost_curve == curve and len(measured) == 1  # read back
    _engine(dspark_checkpoint, speculative_tokens=3, max_num_seqs=3, spec_cost_curve="remeasure")
    assert len(measured) == 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[30, 31, 32], [40, 41, 42, 43, 44]]
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    plain = _engine(dspark_checkpoint, speculative_tokens=0, max_num_seqs=3)
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_cli_speculative_tokens_flag_reaches_the_engine(dspark_checkpoint, monkeypatch):
    import argparse

    from deepinfer.engine.cli import run as cli_run

    parser = argparse.ArgumentParser()
    cli_run.add_engine_options(parser)
    args = parser.parse_args(
        ["--model", str(dspark_checkpoint), "--accelerator", "cpu", "--speculative-tokens", "2",
         "--max-model-len", "64", "--max-num-seqs", "2"]
    )  # fmt: skip
    assert cli_run._engine(args)._core.executor.spec.num_draft_tokens == 2
    args.speculative_tokens = 0
    assert cli_run._engine(args)._core.executor.spec is None
