"""The distilled-sequence file: round trip, size, clear errors on bad input."""

from __future__ import annotations

import io
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest

from structspec.training.sequences import (
    SOURCES,
    TrainSequence,
    load_sequences,
    save_sequences,
)


def _seqs(n: int, vocab: int, seed: int = 0) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2, 60)
        ids = [rng.randrange(vocab) for _ in range(length)]
        out.append(TrainSequence(ids, rng.randint(1, length - 1), SOURCES[i % len(SOURCES)]))
    return out


@pytest.mark.parametrize("vocab", [49152, 128256])  # uint16 and uint32 token arrays
def test_round_trip(tmp_path: Path, vocab: int) -> None:
    seqs = _seqs(200, vocab) + [TrainSequence((vocab - 1, 0), 1, "a longer source name")]
    path = tmp_path / "seqs.bin"  # any name: no suffix is appended
    save_sequences(path, seqs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seqs.bin"]  # no temp file left
    back = load_sequences(path)
    assert back == seqs
    assert all(isinstance(s.token_ids, tuple) and isinstance(s.token_ids[0], int) for s in back)
    with np.load(path) as z:
        assert z["token_ids"].dtype == (np.uint16 if vocab <= 65536 else np.uint32)


def test_compact(tmp_path: Path) -> None:
    """Repetitive text ids compress: 2,000 sequences of 400 ids from a small pool of phrases
    take well under the 2 bytes per id of raw uint16."""
    rng = random.Random(0)
    phrases = [[rng.randrange(49152) for _ in range(rng.randint(3, 12))] for _ in range(300)]
    seqs = []
    for _ in range(2000):
        ids: list[int] = []
        while len(ids) < 400:
            ids += rng.choice(phrases)
        seqs.append(TrainSequence(ids[:400], 50, "sharegpt"))
    path = tmp_path / "s.npz"
    save_sequences(path, seqs)
    assert path.stat().st_size < 2000 * 400 * 2 * 0.6


def test_sequence_checks() -> None:
    assert TrainSequence([5, 6, 7], 2, "sharegpt").num_response_tokens == 1
    with pytest.raises(ValueError, match="num_prompt_tokens must be in"):
        TrainSequence((1, 2), 2, "sharegpt")  # no response token
    with pytest.raises(ValueError, match="num_prompt_tokens must be in"):
        TrainSequence((1, 2), 0, "sharegpt")
    with pytest.raises(ValueError, match="source must be a non-empty string"):
        TrainSequence((1, 2), 1, "")
    assert TrainSequence((1, 2), 1, "synthetic").source == "synthetic"  # any name


def test_save_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no sequences to save"):
        save_sequences(tmp_path / "s.npz", [])
    with pytest.raises(ValueError, match="token id -1 is negative"):
        save_sequences(tmp_path / "s.npz", [TrainSequence((3, -1), 1, "schema")])
    assert not list(tmp_path.iterdir())


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    path.write_bytes(buf.getvalue())
    return path


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such sequence file"):
        load_sequences(tmp_path / "missing.npz")
    good = tmp_path / "good.npz"
    save_sequences(good, _seqs(10, 1000))
    data = good.read_bytes()
    bad_files = {
        "garbage.npz": b"this is not a zip file at all",
        "cut.npz": data[: len(data) // 2],
        "empty.npz": b"",
    }
    for name, content in bad_files.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match="not a training sequence file") as e:
            load_sequences(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
        assert "pickle" not in str(e.value), e.value  # np.load's advice to unpickle it
    with pytest.raises(ValueError, match=r"missing arrays \['format_version'"):
        load_sequences(_npz(tmp_path / "other.npz", x=np.zeros(3)))
    with zipfile.ZipFile(good) as z:
        arrays = {n[:-4]: np.load(io.BytesIO(z.read(n))) for n in z.namelist()}
    corruptions = {
        "format_version": (np.int64(99), "format_version"),
        "offsets": (arrays["offsets"][::-1].copy(), "offsets do not cut token_ids"),
        "num_prompt": (arrays["num_prompt"] + 100, "prompt length is not in"),
        "source_codes": (arrays["source_codes"] + 7, "source code is >="),
        "source_names": (np.array(["", "x", "y"]), "source_names"),
        "token_ids": (arrays["token_ids"].astype(np.float32), "token_ids has dtype float32"),
    }
    for key, (value, message) in corruptions.items():
        path = _npz(tmp_path / f"bad_{key}.npz", **{**arrays, key: value})
        with pytest.raises(ValueError, match=message) as e:
            load_sequences(path)
        assert str(path) in str(e.value) and "corrupt training sequence file" in str(e.value)
