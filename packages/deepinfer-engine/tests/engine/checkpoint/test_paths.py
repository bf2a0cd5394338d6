"""Model path resolution: local directory, DEEPINFER_HF_MODEL_DIR, hub id (mocked)."""

from __future__ import annotations

import huggingface_hub
import pytest

from deepinfer.engine.checkpoint import DEFAULT_MODEL, CheckpointError, resolve_model_path


def _checkpoint_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, tuple(allow_patterns or ())))
        return str(_checkpoint_dir(tmp_path / "hub" / repo_id.replace("/", "--")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    return calls


def test_local_directory_wins_over_everything(tmp_path, fake_hub, monkeypatch):
    local = _checkpoint_dir(tmp_path / "local")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(_checkpoint_dir(tmp_path / "env")))
    assert resolve_model_path(local) == local
    assert fake_hub == []


def test_environment_overrides_the_hub(tmp_path, fake_hub, monkeypatch):
    env_dir = _checkpoint_dir(tmp_path / "env")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(env_dir))
    assert resolve_model_path("deepseek-ai/DeepSeek-V4-Flash") == env_dir
    assert resolve_model_path() == env_dir
    assert fake_hub == []


def test_hub_id_downloads_into_the_cache(fake_hub):
    path = resolve_model_path("deepseek-ai/DeepSeek-V4-Flash", revision="abc")
    assert path.name == "deepseek-ai--DeepSeek-V4-Flash"
    repo, revision, patterns = fake_hub[0]
    assert (repo, revision) == ("deepseek-ai/DeepSeek-V4-Flash", "abc")
    assert "*.safetensors" in patterns and "*.json" in patterns
    resolve_model_path()
    assert fake_hub[1][0] == DEFAULT_MODEL == "deepseek-ai/DeepSeek-V4.1-Flash-1017"


def test_bad_inputs_name_the_field(tmp_path, fake_hub, monkeypatch):
    with pytest.raises(CheckpointError, match="model = '/no/such/dir'"):
        resolve_model_path("/no/such/dir")
    with pytest.raises(CheckpointError, match="download=False"):
        resolve_model_path("org/name", download=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="expected a config.json"):
        resolve_model_path(empty)
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="DEEPINFER_HF_MODEL_DIR"):
        resolve_model_path("org/name")
    assert fake_hub == []


def test_dummy_loads_fetch_no_weights(fake_hub):
    resolve_model_path("org/name", weights=False)
    patterns = fake_hub[0][2]
    assert "*.json" in patterns and not any("safetensors" in p for p in patterns)
