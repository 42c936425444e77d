"""Output paths are probed by writing, not with ``os.access`` (which root passes on ``/sys``):
``structspec generate --out-file`` and ``structspec train-eagle --out`` share one helper,
:mod:`structspec.write_probe`, and refuse such a place before any model loads (issue 17)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from structspec.cli import main
from structspec.training.train_eagle import prepare_out
from structspec.write_probe import probe_dir_writable, probe_file_writable


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory no file can be created in although ``os.access`` may say otherwise: ``/sys``
    as root (root passes ``os.access`` there), a mode-0500 directory otherwise."""
    if os.geteuid() == 0:
        sys_dir = Path("/sys")
        if not sys_dir.is_dir():
            pytest.skip("no /sys here")
        try:
            probe_dir_writable(sys_dir)
        except OSError:
            yield sys_dir
            return
        pytest.skip("/sys takes new files here")
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        yield ro
    finally:
        ro.chmod(0o700)


def test_probe_refuses_what_os_access_lets_through(unwritable_dir: Path) -> None:
    with pytest.raises(OSError):
        probe_dir_writable(unwritable_dir)
    with pytest.raises(OSError):
        probe_file_writable(unwritable_dir / "results.jsonl")


def test_probe_leaves_no_trace_and_keeps_an_existing_file(tmp_path: Path) -> None:
    probe_file_writable(tmp_path / "new.jsonl")
    assert list(tmp_path.iterdir()) == []  # the output itself is not created
    old = tmp_path / "old.jsonl"
    old.write_text("earlier results\n")
    probe_file_writable(old)
    assert old.read_text() == "earlier results\n" and list(tmp_path.iterdir()) == [old]


def test_generate_out_file_is_probed_before_the_model_loads(
        unwritable_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import structspec.llm as llm_mod

    loaded: list[Any] = []
    monkeypatch.setattr(llm_mod, "LLM", lambda *a, **kw: loaded.append(a))
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "a"}\n')
    out = unwritable_dir / "results.jsonl"
    rc = main(["generate", "--batch", str(batch), "--out-file", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"structspec generate: --out-file: {str(out)!r} is not "
                                      "writable: "), err
    assert loaded == []


def test_train_eagle_out_uses_the_same_probe(unwritable_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^out: directory .* is not writable: "):
        prepare_out(str(unwritable_dir))
