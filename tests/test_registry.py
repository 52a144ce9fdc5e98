"""Resolving --model values (registry.models) without MLflow: directories, and the default
model, which resolution finds but never builds (a Serve replica must not train tiny-sala)."""
import pytest

from registry.models import ModelSpecError, default_model, resolve_model_path


def test_default_model_is_found_never_built(tmp_path, monkeypatch, tiny_sala_dir):
    assert resolve_model_path(None) == tiny_sala_dir
    monkeypatch.setenv("SALA_HOME", str(tmp_path))
    with pytest.raises(ModelSpecError) as e:
        default_model()
    assert str(e.value).startswith("no model given and tiny-sala is not built at ")
    assert "python -m sala.tiny" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing was built or created


def test_directories_resolve_to_themselves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    assert resolve_model_path("ckpt") == tmp_path / "ckpt"
    with pytest.raises(ModelSpecError, match=r"^nope: no such model directory \(nor a models:/ registry URI\)$"):
        resolve_model_path("nope")
