from __future__ import annotations

import pytest

from deepinfer.kernels import envs


def test_defaults_and_parsing(monkeypatch):
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    assert envs.get("DEEPINFER_BATCH_INVARIANT") is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert envs.batch_invariant() is True
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", " 3 ")
    assert envs.get("DEEPINFER_USE_NEXTN_DECODE") == 3


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT='maybe'"):
        envs.get("DEEPINFER_BATCH_INVARIANT")


def test_unregistered_name_is_refused():
    with pytest.raises(KeyError, match="not a registered"):
        envs.get("DEEPINFER_NOT_A_THING")
