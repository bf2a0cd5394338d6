"""``DEEPINFER_LOG_LEVEL`` sets the level of the ``deepinfer`` loggers when the engine starts
or the command line runs; an unknown level fails with a message naming the variable."""

from __future__ import annotations

import logging

import pytest

from deepinfer.engine.cli import main
from deepinfer.engine.logs import set_log_level


@pytest.fixture(autouse=True)
def _restore_level():
    logger = logging.getLogger("deepinfer")
    before = logger.level
    yield
    logger.setLevel(before)


def test_the_variable_sets_the_deepinfer_loggers(monkeypatch):
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "debug")
    assert set_log_level() == logging.DEBUG
    assert logging.getLogger("deepinfer.engine").getEffectiveLevel() == logging.DEBUG
    monkeypatch.delenv("DEEPINFER_LOG_LEVEL")
    assert set_log_level() == logging.INFO
    assert logging.getLogger("deepinfer.kernels").getEffectiveLevel() == logging.INFO


def test_an_unknown_level_fails_clearly(monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="DEEPINFER_LOG_LEVEL='loud': expected one of DEBUG"):
        set_log_level()
    assert main(["info", "--accelerator", "cpu"]) == 2
    assert "deepinfer: error: DEEPINFER_LOG_LEVEL='loud'" in capsys.readouterr().err


def test_the_engine_applies_it_at_start(monkeypatch):
    from deepinfer.engine.frontend.llm import LLM

    monkeypatch.setenv("DEEPINFER_LOG_LEVEL", "warning")
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        LLM("x", accelerator="tpu")  # the level is set before the arguments are checked
    assert logging.getLogger("deepinfer").level == logging.WARNING
