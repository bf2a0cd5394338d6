"""Context-parallel layouts the engine refuses at start-up, each with one line naming the field:
a CP size that does not divide the ranks or a ``cp_min_tokens`` below 1 (when the config is
built), a model without compressed attention (when the model's config is read, before any
weight loads)."""

from __future__ import annotations

import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.runner.loading import check_context_parallel_model
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config


@pytest.mark.parametrize(("cp", "dp"), [(2, 1), (2, 3), (4, 2), (0, 2)])
def test_cp_not_dividing_the_ranks_is_refused_when_the_config_is_built(cp, dp):
    with pytest.raises(ValueError, match=rf"^context_parallel_size(={cp})?: expected"):
        EngineConfig(model="x", context_parallel_size=cp, data_parallel_size=dp)


def test_a_model_without_compressed_attention_is_refused():
    config = EngineConfig(model="x", context_parallel_size=2, data_parallel_size=2)
    window_only = parse_config(tiny_v4_config(compress_ratios=[0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="context_parallel_size=2: this model has no compressed"):
        check_context_parallel_model(config, window_only)


@pytest.mark.parametrize("raw", [tiny_v4_config(), tiny_v41_config(vision=False)])
def test_a_valid_layout_passes(raw):
    check_context_parallel_model(EngineConfig(model="x"), parse_config(raw))  # CP = 1
    config = EngineConfig(model="x", context_parallel_size=2, data_parallel_size=4)
    check_context_parallel_model(config, parse_config(raw))


def test_cp_min_tokens_must_be_positive():
    with pytest.raises(ValueError, match=r"^cp_min_tokens"):
        EngineConfig(model="x", context_parallel_size=2, data_parallel_size=2, cp_min_tokens=0)


def test_llm_refuses_cp_on_a_model_without_compressed_attention_before_any_process(tmp_path):
    import json

    from deepinfer.engine.frontend.llm import LLM

    window_only = tiny_v4_config(compress_ratios=[0, 0, 0, 0, 0])
    (tmp_path / "config.json").write_text(json.dumps(window_only))
    with pytest.raises(ValueError, match="context_parallel_size=2: this model has no compressed"):
        LLM(str(tmp_path), accelerator="cpu", data_parallel_size=2, context_parallel_size=2)


def test_yoco_truncation_is_refused_with_cp_when_a_rank_loads():
    from types import SimpleNamespace

    from deepinfer.engine.config import LoadedModel
    from deepinfer.engine.runner.context_executor import with_context_parallel

    model = SimpleNamespace(truncation=object())  # what load_executor sets when it is on
    executor = SimpleNamespace(model=model, cache=None, num_draft_tokens=0)
    loaded = LoadedModel(executor, None, 8, frozenset(), 64, num_blocks=2, num_state_slots=2)
    config = EngineConfig(model="x", context_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size=2: YoCo prefill truncation"):
        with_context_parallel(loaded, config)
