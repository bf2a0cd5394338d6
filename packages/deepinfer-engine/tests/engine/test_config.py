"""One declaration of the engine's parameters: ``LLM``'s keywords, ``EngineConfig`` and the
command line's engine flags come from it, and values left to the environment are settled when
the config is built (the argument first)."""

from __future__ import annotations

import argparse
import inspect

import pytest

from deepinfer.engine import LLM
from deepinfer.engine.cli.run import add_engine_options
from deepinfer.engine.config import DEFAULT_MODEL, EngineConfig

TODAYS_FLAGS = {
    "--model": None,
    "--accelerator": "auto",
    "--dtype": None,  # float32 on cpu, else bfloat16
    "--max-model-len": None,
    "--max-num-seqs": 256,
    "--load-format": "auto",
    "--speculative-tokens": None,
    "--enforce-eager": False,
}


def test_llm_keywords_are_the_declared_parameters():
    signature = inspect.signature(LLM)
    declared = EngineConfig.parameters()
    assert list(signature.parameters) == [f.name for f in declared]
    assert all(signature.parameters[f.name].default == f.default for f in declared)
    assert all(f"        {f.name}: " in LLM.__doc__ for f in declared)
    assert "cap_speculative_tokens" not in signature.parameters


def test_an_unknown_keyword_names_itself():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences'"):
        LLM("x", max_num_sequences=4)
    with pytest.raises(TypeError, match="'cap_speculative_tokens'"):
        LLM("x", cap_speculative_tokens=True)


def test_the_command_line_keeps_its_flags_and_defaults():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for flag, default in TODAYS_FLAGS.items():
        assert actions[flag].default == default, flag
    assert actions["--accelerator"].choices == ("auto", "nvidia", "ascend", "cpu")
    args = parser.parse_args(["--max-num-seqs", "3", "--no-enable-chunked-prefill"])
    assert args.max_num_seqs == 3 and args.enable_chunked_prefill is False


def test_the_environment_is_read_once_when_the_config_is_built(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/models/v4")
    config = EngineConfig()
    assert (config.model, config.speculative_tokens, config.spec_varlen) == ("/models/v4", 2, True)
    assert config.cap_speculative_tokens
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "4")
    assert config.speculative_tokens == 2  # settled: a later change does not reach it
    explicit = EngineConfig(model="m", speculative_tokens=1, spec_varlen=False)
    assert (explicit.speculative_tokens, explicit.spec_varlen) == (1, False)
    assert not explicit.cap_speculative_tokens
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    assert EngineConfig().model == DEFAULT_MODEL
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "-1")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=-1: expected >= 0"):
        EngineConfig(model="m")


def test_the_token_budget_follows_chunked_prefill():
    assert EngineConfig(model="m").max_num_batched_tokens == 8192
    config = EngineConfig(model="m", enable_chunked_prefill=False, max_model_len=10000)
    assert config.max_num_batched_tokens == 10000
    with pytest.raises(ValueError, match="max_num_batched_tokens=0: expected a positive integer"):
        EngineConfig(model="m", max_num_batched_tokens=0)
